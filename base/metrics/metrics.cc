#include "base/metrics/metrics.h"

#include <dirent.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <exception>
#include <fstream>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "httplib.h"
#include "prometheus/text_serializer.h"

#ifndef OFFLOAD_VERSION
#define OFFLOAD_VERSION "unknown"
#endif

namespace offload {
namespace {

prometheus::MetricFamily Family(const std::string& name, const std::string& help,
                                prometheus::MetricType type = prometheus::MetricType::Gauge) {
  prometheus::MetricFamily family;
  family.name = name;
  family.help = help;
  family.type = type;
  return family;
}

void AddValue(prometheus::MetricFamily* family, double value) {
  prometheus::ClientMetric metric;
  if (family->type == prometheus::MetricType::Counter) {
    metric.counter.value = value;
  } else {
    metric.gauge.value = value;
  }
  family->metric.push_back(std::move(metric));
}

// The fields of /proc/self/stat after the command name, which may itself hold spaces and
// parentheses: field 3 (state) is at index 0.
std::vector<std::string> ProcSelfStatFields() {
  std::ifstream in("/proc/self/stat");
  std::string line;
  std::getline(in, line);
  const size_t close = line.rfind(')');
  if (close == std::string::npos) return {};
  return absl::StrSplit(absl::string_view(line).substr(close + 1), ' ', absl::SkipEmpty());
}

double BootTimeSeconds() {
  std::ifstream in("/proc/stat");
  std::string key;
  double value = 0;
  while (in >> key) {
    if (key == "btime") {
      in >> value;
      return value;
    }
    in.ignore(1 << 20, '\n');
  }
  return 0;
}

int OpenFds() {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return 0;
  int n = 0;
  while (dirent* e = readdir(dir)) {
    if (e->d_name[0] != '.') ++n;
  }
  closedir(dir);
  return n - 1;  // the directory stream's own descriptor
}

class ProcessCollector : public prometheus::Collectable {
 public:
  ProcessCollector() : ticks_(sysconf(_SC_CLK_TCK)), page_(sysconf(_SC_PAGESIZE)) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    std::vector<prometheus::MetricFamily> out;
    const std::vector<std::string> f = ProcSelfStatFields();
    // utime 14, stime 15, starttime 22, vsize 23, rss 24 (1-based, proc(5)); index = field - 3.
    auto field = [&](int n) {
      double v = 0;
      if (static_cast<int>(f.size()) > n - 3) (void)absl::SimpleAtod(f[n - 3], &v);
      return v;
    };
    if (f.size() >= 22) {
      out.push_back(Family("process_cpu_seconds_total",
                           "Total user and system CPU time spent in seconds.",
                           prometheus::MetricType::Counter));
      AddValue(&out.back(), (field(14) + field(15)) / ticks_);
      out.push_back(Family("process_start_time_seconds",
                           "Start time of the process since unix epoch in seconds."));
      AddValue(&out.back(), boot_time_ + field(22) / ticks_);
      out.push_back(Family("process_virtual_memory_bytes", "Virtual memory size in bytes."));
      AddValue(&out.back(), field(23));
      out.push_back(Family("process_resident_memory_bytes", "Resident memory size in bytes."));
      AddValue(&out.back(), field(24) * page_);
    }
    out.push_back(Family("process_open_fds", "Number of open file descriptors."));
    AddValue(&out.back(), OpenFds());
    return out;
  }

 private:
  const double ticks_;
  const double page_;
  const double boot_time_ = BootTimeSeconds();
};

}  // namespace

prometheus::Registry& MetricsRegistry() {
  static prometheus::Registry* registry = new prometheus::Registry();
  return *registry;
}

const std::vector<double>& DurationBuckets() {
  static const std::vector<double>* buckets = [] {
    auto* b = new std::vector<double>();
    for (double s = 0.001; s < 200; s *= 2) b->push_back(s);
    return b;
  }();
  return *buckets;
}

std::vector<prometheus::MetricFamily> CallbackMetric::Collect() const {
  prometheus::MetricFamily family = Family(name_, help_, type_);
  for (const Sample& s : collect_()) {
    AddValue(&family, s.value);
    for (const auto& [name, value] : s.labels) family.metric.back().label.push_back({name, value});
  }
  return {std::move(family)};
}

std::shared_ptr<prometheus::Collectable> MakeProcessCollector() {
  return std::make_shared<ProcessCollector>();
}

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(const std::string& address,
                                                                    const std::string& binary) {
  const size_t colon = address.rfind(':');
  int port = -1;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port) ||
      port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address '", address, "' is not HOST:PORT"));
  }
  std::string host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  std::unique_ptr<MetricsServer> server(new MetricsServer());
  server->http_ = std::make_unique<httplib::Server>();
  // Scrapes are small and rare: two threads serve them without taking cores from training.
  server->http_->new_task_queue = [] { return new httplib::ThreadPool(2); };
  server->http_->set_socket_options(ExclusiveListenSocketOptions);
  MetricsServer* self = server.get();
  server->http_->Get("/metrics", [self](const httplib::Request&, httplib::Response& response) {
    response.set_content(self->Render(), "text/plain; version=0.0.4; charset=utf-8");
  });
  if (port == 0) {
    port = server->http_->bind_to_any_port(host);
  } else if (!server->http_->bind_to_port(host, port)) {
    port = -1;
  }
  if (port < 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", address, " (address in use, or not this host's)"));
  }
  server->address_ = absl::StrCat(address.substr(0, colon), ":", port);
  server->thread_ = std::thread([self] {
    self->http_->listen_after_bind();
    self->loop_ended_ = true;
  });
  // stop() in the destructor only acts once the accept loop runs.
  while (!server->http_->is_running() && !server->loop_ended_) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (server->loop_ended_) {
    return absl::UnavailableError(absl::StrCat("serving metrics on ", address, " failed"));
  }

  prometheus::Gauge& info = prometheus::BuildGauge()
                                .Name("offload_build_info")
                                .Help("Which Offload program this is; always 1.")
                                .Register(MetricsRegistry())
                                .Add({{"binary", binary}, {"version", OFFLOAD_VERSION}});
  info.Set(1);
  // The registry is process-wide and never destroyed, so a non-owning pointer is safe.
  server->Add(std::shared_ptr<prometheus::Collectable>(&MetricsRegistry(),
                                                       [](prometheus::Collectable*) {}));
  server->Add(MakeProcessCollector());
  return server;
}

MetricsServer::~MetricsServer() {
  if (thread_.joinable()) {
    http_->stop();
    thread_.join();
  }
}

void MetricsServer::Add(std::shared_ptr<prometheus::Collectable> collectable) {
  std::lock_guard<std::mutex> lock(mu_);
  collectables_.push_back(std::move(collectable));
}

std::string MetricsServer::Render() const {
  std::vector<prometheus::MetricFamily> families;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& c : collectables_) {
      std::vector<prometheus::MetricFamily> more = c->Collect();
      families.insert(families.end(), std::make_move_iterator(more.begin()),
                      std::make_move_iterator(more.end()));
    }
  }
  return prometheus::TextSerializer().Serialize(families);
}

void ExclusiveListenSocketOptions(int socket) {
  int yes = 1;
  setsockopt(socket, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
}

absl::StatusOr<std::unique_ptr<MetricsServer>> StartMetricsServerIfAsked(
    const std::string& address, const std::string& binary) {
  if (address.empty()) return std::unique_ptr<MetricsServer>();
  absl::StatusOr<std::unique_ptr<MetricsServer>> server = MetricsServer::Start(address, binary);
  if (server.ok()) {
    std::printf("%s: metrics on http://%s/metrics\n", binary.c_str(), (*server)->address().c_str());
    std::fflush(stdout);
  }
  return server;
}

}  // namespace offload
