#include "services/job_controller/grpc_services.h"

#include <unistd.h>

#include <cstdio>
#include <memory>
#include <string>

#include "base/security/security.h"
#include "gtest/gtest.h"
#include "services/job_controller/job_controller.h"
#include "services/job_controller/job_store.h"

namespace offload {
namespace {

class GrpcServicesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* dir = std::getenv("TEST_TMPDIR");
    path_ = std::string(dir != nullptr ? dir : "/tmp") + "/grpc_services_test_" +
            std::to_string(getpid()) + ".db";
    for (const char* suffix : {"", "-wal", "-shm"}) std::remove((path_ + suffix).c_str());
    store_ = *JobStore::Open(path_);
    JobControllerOptions options;
    options.store = store_.get();
    controller_ = *JobController::Create(options);
    tokens_.Add("right-token");
    identities_ = Identities::WithTable(tokens_, TenantTable());
    job_service_ = std::make_unique<JobServiceImpl>(controller_.get(), identities_.get());
    worker_service_ = std::make_unique<WorkerServiceImpl>(controller_.get(), &tokens_);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(job_service_.get());
    builder.RegisterService(worker_service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                       grpc::InsecureChannelCredentials());
    jobs_ = v1::JobService::NewStub(channel);
    workers_ = v1::WorkerService::NewStub(channel);
  }

  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown();
    server_.reset();
    controller_.reset();
    store_.reset();
    for (const char* suffix : {"", "-wal", "-shm"}) std::remove((path_ + suffix).c_str());
  }

  std::string path_;
  std::unique_ptr<JobStore> store_;
  std::unique_ptr<JobController> controller_;
  BearerTokens tokens_;
  std::unique_ptr<Identities> identities_;
  std::unique_ptr<JobServiceImpl> job_service_;
  std::unique_ptr<WorkerServiceImpl> worker_service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::JobService::Stub> jobs_;
  std::unique_ptr<v1::WorkerService::Stub> workers_;
};

TEST_F(GrpcServicesTest, CallsNeedTheToken) {
  v1::ListJobsRequest request;
  v1::ListJobsResponse response;
  {
    grpc::ClientContext context;
    grpc::Status status = jobs_->ListJobs(&context, request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    grpc::ClientContext context;
    AttachBearer(&context, "wrong-token");
    grpc::Status status = jobs_->ListJobs(&context, request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
    EXPECT_EQ(status.error_message().find("wrong-token"), std::string::npos);
  }
  {
    grpc::ClientContext context;
    AttachBearer(&context, "right-token");
    grpc::Status status = jobs_->ListJobs(&context, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
  }
  v1::RegisterWorkerRequest reg;
  reg.mutable_worker()->set_kind(v1::WORKER_KIND_TRAINER);
  v1::RegisterWorkerResponse registered;
  {
    grpc::ClientContext context;
    EXPECT_EQ(workers_->RegisterWorker(&context, reg, &registered).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    grpc::ClientContext context;
    AttachBearer(&context, "right-token");
    grpc::Status status = workers_->RegisterWorker(&context, reg, &registered);
    EXPECT_TRUE(status.ok()) << status.error_message();
    EXPECT_FALSE(registered.worker_id().empty());
  }
}

TEST_F(GrpcServicesTest, ErrorsKeepTheirCodeAndMessage) {
  v1::GetJobRequest request;
  request.set_id("job-12");
  v1::Job job;
  grpc::ClientContext context;
  AttachBearer(&context, "right-token");
  grpc::Status status = jobs_->GetJob(&context, request, &job);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(status.error_message(), "job job-12 not found");

  v1::SubmitJobRequest submit;
  grpc::ClientContext submit_context;
  AttachBearer(&submit_context, "right-token");
  status = jobs_->SubmitJob(&submit_context, submit, &job);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("data.path"), std::string::npos) << status.error_message();
}

TEST_F(GrpcServicesTest, RendezvousGetStopsAtTheCallersDeadline) {
  v1::SubmitJobRequest submit;
  submit.mutable_spec()->mutable_data()->set_path("/data/x.txt");
  ASSERT_TRUE(controller_->SubmitJob(Caller::Operator(), submit).ok());
  v1::RegisterWorkerRequest reg;
  reg.mutable_worker()->set_kind(v1::WORKER_KIND_TRAINER);
  ASSERT_TRUE(controller_->RegisterWorker(reg).ok());
  reg.mutable_worker()->set_kind(v1::WORKER_KIND_OPTIMIZER_SERVER);
  reg.mutable_worker()->set_address("127.0.0.1:1");
  ASSERT_TRUE(controller_->RegisterWorker(reg).ok());

  v1::RendezvousGetRequest get;
  get.mutable_attempt()->set_job_id("job-1");
  get.mutable_attempt()->set_attempt(1);
  get.add_keys("missing");
  get.set_timeout_ms(600000);
  v1::RendezvousGetResponse response;
  grpc::ClientContext context;
  AttachBearer(&context, "right-token");
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
  const auto start = std::chrono::steady_clock::now();
  grpc::Status status = workers_->RendezvousGet(&context, get, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  // The server gave up too, rather than holding its thread for ten minutes: shutdown is prompt.
  server_->Shutdown();
  server_.reset();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

}  // namespace
}  // namespace offload
