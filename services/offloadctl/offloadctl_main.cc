// offloadctl: the command line of the job controller (ARCHITECTURE.md section 7). A plain gRPC
// client of offload.v1.JobService, so it works against any server of that service.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/grpc_status.h"
#include "base/security/security.h"
#include "grpcpp/grpcpp.h"
#include "jobs/spec/job_spec.h"
#include "offload/v1/job.grpc.pb.h"
#include "services/offloadctl/job_format.h"

ABSL_FLAG(std::string, controller, "",
          "the job controller's gRPC address, host:port; default $OFFLOAD_CONTROLLER, else "
          "127.0.0.1:7070");
ABSL_FLAG(std::string, output, "table", "table (for people) or json (protobuf JSON); also -o json");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(10), "deadline of each call to the controller");
ABSL_FLAG(absl::Duration, interval, absl::Seconds(1), "watch, logs --follow: time between polls");
ABSL_FLAG(std::string, state, "",
          "list: only jobs in these states, comma-separated (e.g. running,paused)");
ABSL_FLAG(std::string, reason, "",
          "pause, resume, checkpoint, cancel: why, recorded in the job's events");
ABSL_FLAG(uint64_t, after, 0, "audit: only the records after this sequence number");
ABSL_FLAG(bool, follow, false, "logs: keep printing new events until the job stops");

namespace offload {
namespace {

constexpr int kUsageError = 2;
// watch and logs --follow ride out a controller restart for this long before giving up.
constexpr absl::Duration kUnavailableGrace = absl::Seconds(60);

constexpr char kUsage[] =
    R"(usage: offloadctl [flags] COMMAND [ARGS]

Commands:
  submit FILE                 submit the job in FILE (YAML or JSON JobSpec); prints its id
  list [--state=S,...]        list jobs, newest first
  get ID                      show a job: state, reason, attempt, progress, last checkpoint
  watch ID                    print a line whenever the job's state or progress changes, until it
                              stops; exit status: 0 succeeded, 1 failed, 2 cancelled, 3 paused
  pause ID [--reason=...]     checkpoint and stop; resume continues from the checkpoint
  resume ID [--reason=...]
  checkpoint ID [--reason=...]
  cancel ID [--reason=...]
  logs ID [--follow]          the job's events: time, state, attempt, message
  audit [--after=N]           the audit log (admins): who did what to which job, and the outcome

Exit status (other than watch): 0 done, 1 the call or the job file failed, 2 usage error.
With -o json every command prints protobuf JSON (.proto field names); watch and logs print one
JSON object per line.
The controller is --controller, else $OFFLOAD_CONTROLLER, else 127.0.0.1:7070. The bearer token
comes from $OFFLOAD_TOKEN or the first line of --token_file; TLS is on when --tls_ca is set.
)";

struct CommandLine {
  std::vector<std::string> positional;
  std::set<std::string> flags_given;
  bool help = false;
};

std::string FlagHelp() {
  std::map<std::string, const absl::CommandLineFlag*> ours;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    const std::string file = flag->Filename();
    if (absl::StrContains(file, "offloadctl") || absl::StrContains(file, "security_flags")) {
      ours[std::string(name)] = flag;
    }
  }
  std::string text = "\nFlags:\n";
  for (const auto& [name, flag] : ours) {
    absl::StrAppend(&text, "  --", name, " (default: \"", flag->DefaultValue(), "\")\n      ",
                    flag->Help(), "\n");
  }
  return text;
}

// Our own pass over argv rather than absl::ParseCommandLine: it exits 1 on a bad flag where a
// usage error here is 2, and kubectl habits like "-o json" need a short option.
absl::StatusOr<CommandLine> ParseArgs(int argc, char** argv) {
  CommandLine line;
  bool only_positional = false;
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (only_positional || arg == "-" || !absl::StartsWith(arg, "-")) {
      line.positional.emplace_back(arg);
      continue;
    }
    if (arg == "--") {
      only_positional = true;
      continue;
    }
    std::string name;
    std::string value;
    bool has_value = false;
    if (arg == "-h") {
      line.help = true;
      continue;
    }
    // "-o json", "-o=json", "-ojson"; "-output=json" is absl's single-dash long form.
    if (arg == "-o" || absl::StartsWith(arg, "-o=") || arg == "-ojson" || arg == "-otable") {
      name = "output";
      if (arg == "-o") {
        if (i + 1 >= argc) return absl::InvalidArgumentError("-o needs a value (table or json)");
        value = argv[++i];
      } else {
        value = std::string(absl::StripPrefix(arg.substr(2), "="));
      }
      has_value = true;
    } else {
      absl::string_view body = absl::StripPrefix(absl::StripPrefix(arg, "-"), "-");
      const size_t eq = body.find('=');
      name = std::string(body.substr(0, eq));
      if (eq != absl::string_view::npos) {
        value = std::string(body.substr(eq + 1));
        has_value = true;
      }
    }
    if (name == "help" || name == "helpfull") {
      line.help = true;
      continue;
    }
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag == nullptr && !has_value && absl::StartsWith(name, "no")) {
      absl::CommandLineFlag* negated = absl::FindCommandLineFlag(name.substr(2));
      if (negated != nullptr && negated->IsOfType<bool>()) {
        flag = negated;
        value = "false";
        has_value = true;
      }
    }
    if (flag == nullptr) return absl::InvalidArgumentError(absl::StrCat("unknown flag ", arg));
    if (!has_value) {
      if (flag->IsOfType<bool>()) {
        value = "true";
      } else if (i + 1 < argc) {
        value = argv[++i];
      } else {
        return absl::InvalidArgumentError(absl::StrCat("--", name, " needs a value"));
      }
    }
    std::string error;
    if (!flag->ParseFrom(value, &error)) {
      return absl::InvalidArgumentError(absl::StrCat("--", name, ": ", error));
    }
    line.flags_given.insert(std::string(flag->Name()));
  }
  return line;
}

int UsageError(absl::string_view message) {
  std::fprintf(stderr, "offloadctl: %s\n\n%s", std::string(message).c_str(), kUsage);
  return kUsageError;
}

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "offloadctl: %s: %s\n", absl::StatusCodeToString(status.code()).c_str(),
               std::string(status.message()).c_str());
  return 1;
}

void Print(const std::string& text) {
  std::fputs(text.c_str(), stdout);
  if (!text.empty() && text.back() != '\n') std::fputc('\n', stdout);
  std::fflush(stdout);
}

// Where watch stops, and its exit status.
int WatchExitCode(v1::JobState state) {
  switch (state) {
    case v1::JOB_STATE_SUCCEEDED:
      return 0;
    case v1::JOB_STATE_FAILED:
      return 1;
    case v1::JOB_STATE_CANCELLED:
      return 2;
    case v1::JOB_STATE_PAUSED:
      return 3;
    default:
      return -1;
  }
}

class Ctl {
 public:
  Ctl(std::shared_ptr<grpc::Channel> channel, std::string token, bool json)
      : stub_(v1::JobService::NewStub(channel)), token_(std::move(token)), json_(json) {}

  int Submit(const std::string& file) {
    absl::StatusOr<v1::JobSpec> spec = ReadJobSpecFile(file);
    if (!spec.ok()) return Fail(spec.status());
    v1::SubmitJobRequest request;
    *request.mutable_spec() = *std::move(spec);
    v1::Job job;
    if (absl::Status s = Call(&Stub::SubmitJob, request, &job); !s.ok()) return Fail(s);
    // The bare id, so that ID=$(offloadctl submit job.yaml) works.
    Print(json_ ? ToJson(job, false) : job.id());
    return 0;
  }

  int List(const std::vector<v1::JobState>& states) {
    v1::ListJobsRequest request;
    for (v1::JobState state : states) request.add_states(state);
    v1::ListJobsResponse all;
    // Every page: a listing that silently stops at the first hundred would mislead.
    for (int page = 0; page < 10000; ++page) {
      v1::ListJobsResponse response;
      if (absl::Status s = Call(&Stub::ListJobs, request, &response); !s.ok()) return Fail(s);
      for (v1::Job& job : *response.mutable_jobs()) *all.add_jobs() = std::move(job);
      if (response.next_page_token().empty() ||
          response.next_page_token() == request.page_token()) {
        break;
      }
      request.set_page_token(response.next_page_token());
    }
    if (json_) {
      Print(ToJson(all, false));
    } else {
      Print(JobTable({all.jobs().begin(), all.jobs().end()}, absl::Now()));
    }
    return 0;
  }

  int Audit(uint64_t after) {
    v1::ListAuditRequest request;
    request.set_after_sequence(after);
    request.set_page_size(1000);
    v1::ListAuditResponse all;
    // Every page, as List does.
    while (true) {
      v1::ListAuditResponse response;
      if (absl::Status s = Call(&Stub::ListAudit, request, &response); !s.ok()) return Fail(s);
      if (response.records().empty()) break;
      request.set_after_sequence(response.records().rbegin()->sequence());
      for (v1::AuditRecord& record : *response.mutable_records()) {
        *all.add_records() = std::move(record);
      }
    }
    if (json_) {
      Print(ToJson(all, false));
    } else {
      std::string text;
      for (const v1::AuditRecord& record : all.records()) {
        absl::StrAppend(&text, AuditLine(record, absl::LocalTimeZone()), "\n");
      }
      Print(text);
    }
    return 0;
  }

  int Get(const std::string& id) {
    v1::Job job;
    if (absl::Status s = GetJob(id, &job); !s.ok()) return Fail(s);
    Print(json_ ? ToJson(job, false) : JobDetails(job, absl::Now(), absl::LocalTimeZone()));
    return 0;
  }

  int Watch(const std::string& id, absl::Duration interval) {
    std::string last;
    absl::Time failing_since = absl::InfiniteFuture();
    while (true) {
      v1::Job job;
      if (absl::Status s = GetJob(id, &job); !s.ok()) {
        if (!RideOut(s, &failing_since)) return Fail(s);
        absl::SleepFor(interval);
        continue;
      }
      failing_since = absl::InfiniteFuture();
      const std::string line = json_ ? ToJson(job, true) : WatchLine(job);
      if (line != last) {
        Print(json_ ? line : absl::StrCat(Clock(), "  ", line));
        last = line;
      }
      if (const int code = WatchExitCode(job.state()); code >= 0) return code;
      absl::SleepFor(interval);
    }
  }

  int Act(const std::string& verb, const std::string& id, const std::string& reason) {
    using Action =
        grpc::Status (Stub::*)(grpc::ClientContext*, const v1::JobActionRequest&, v1::Job*);
    static const std::map<std::string, Action> kActions = {{"pause", &Stub::PauseJob},
                                                           {"resume", &Stub::ResumeJob},
                                                           {"checkpoint", &Stub::CheckpointJob},
                                                           {"cancel", &Stub::CancelJob}};
    v1::JobActionRequest request;
    request.set_id(id);
    request.set_reason(reason);
    v1::Job job;
    if (absl::Status s = Call(kActions.at(verb), request, &job); !s.ok()) return Fail(s);
    Print(json_ ? ToJson(job, false) : absl::StrCat(job.id(), "  ", WatchLine(job)));
    return 0;
  }

  int Logs(const std::string& id, bool follow, absl::Duration interval) {
    v1::ListJobEventsRequest request;
    request.set_id(id);
    absl::Time failing_since = absl::InfiniteFuture();
    while (true) {
      v1::ListJobEventsResponse response;
      if (absl::Status s = Call(&Stub::ListJobEvents, request, &response); !s.ok()) {
        if (!follow || !RideOut(s, &failing_since)) return Fail(s);
        absl::SleepFor(interval);
        continue;
      }
      failing_since = absl::InfiniteFuture();
      bool stopped = false;
      for (const v1::JobEvent& event : response.events()) {
        // A server that ignores after_sequence must not make us print events twice.
        if (request.after_sequence() > 0 && event.sequence() <= request.after_sequence()) {
          continue;
        }
        Print(json_ ? ToJson(event, true) : EventLine(event, absl::LocalTimeZone()));
        request.set_after_sequence(std::max(request.after_sequence(), event.sequence()));
        stopped = WatchExitCode(event.state()) >= 0;
      }
      if (!follow || stopped) return 0;
      absl::SleepFor(interval);
    }
  }

 private:
  using Stub = v1::JobService::StubInterface;

  template <typename Request, typename Response>
  absl::Status Call(grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&, Response*),
                    const Request& request, Response* response) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         absl::ToChronoMilliseconds(absl::GetFlag(FLAGS_timeout)));
    AttachBearer(&context, token_);
    return FromGrpcStatus((stub_.get()->*method)(&context, request, response));
  }

  absl::Status GetJob(const std::string& id, v1::Job* job) {
    v1::GetJobRequest request;
    request.set_id(id);
    return Call(&Stub::GetJob, request, job);
  }

  // Whether to keep polling after `status`: a controller that is restarting is waited for (and
  // said so once on stderr), anything else ends the command.
  static bool RideOut(const absl::Status& status, absl::Time* failing_since) {
    if (status.code() != absl::StatusCode::kUnavailable &&
        status.code() != absl::StatusCode::kDeadlineExceeded) {
      return false;
    }
    const absl::Time now = absl::Now();
    if (*failing_since == absl::InfiniteFuture()) {
      *failing_since = now;
      std::fprintf(stderr, "offloadctl: %s: %s (retrying for %s)\n",
                   absl::StatusCodeToString(status.code()).c_str(),
                   std::string(status.message()).c_str(),
                   absl::FormatDuration(kUnavailableGrace).c_str());
    }
    return now - *failing_since < kUnavailableGrace;
  }

  static std::string Clock() {
    return absl::FormatTime("%H:%M:%S", absl::Now(), absl::LocalTimeZone());
  }

  std::unique_ptr<Stub> stub_;
  const std::string token_;
  const bool json_;
};

// Command → (number of arguments, flags that only make sense with it).
struct CommandInfo {
  size_t args;
  std::set<std::string> flags;
};

const std::map<std::string, CommandInfo>& Commands() {
  static const auto* commands = new std::map<std::string, CommandInfo>{
      {"submit", {1, {}}},
      {"list", {0, {"state"}}},
      {"get", {1, {}}},
      {"watch", {1, {"interval"}}},
      {"pause", {1, {"reason"}}},
      {"resume", {1, {"reason"}}},
      {"checkpoint", {1, {"reason"}}},
      {"cancel", {1, {"reason"}}},
      {"logs", {1, {"follow", "interval"}}},
      {"audit", {0, {"after"}}},
  };
  return *commands;
}

int Run(int argc, char** argv) {
  absl::StatusOr<CommandLine> line = ParseArgs(argc, argv);
  if (!line.ok()) return UsageError(line.status().message());
  if (line->help || (!line->positional.empty() && line->positional[0] == "help")) {
    std::printf("%s%s", kUsage, FlagHelp().c_str());
    return 0;
  }
  if (line->positional.empty()) return UsageError("no command");
  const std::string command = line->positional[0];
  const std::vector<std::string> args(line->positional.begin() + 1, line->positional.end());
  const auto it = Commands().find(command);
  if (it == Commands().end()) return UsageError(absl::StrCat("unknown command '", command, "'"));
  if (args.size() != it->second.args) {
    return UsageError(absl::StrCat(command, " takes ", it->second.args == 0 ? "no" : "one",
                                   " argument", it->second.args == 0 ? "s" : "", ", got ",
                                   args.size()));
  }
  // A flag some command takes is refused on the others; global flags are always allowed.
  std::set<std::string> specific_flags;
  for (const auto& entry : Commands()) {
    specific_flags.insert(entry.second.flags.begin(), entry.second.flags.end());
  }
  for (const std::string& specific : specific_flags) {
    if (line->flags_given.count(specific) > 0 && it->second.flags.count(specific) == 0) {
      return UsageError(absl::StrCat("--", specific, " does not apply to ", command));
    }
  }
  const std::string output = absl::GetFlag(FLAGS_output);
  if (output != "table" && output != "json") {
    return UsageError(absl::StrCat("--output must be table or json, got '", output, "'"));
  }
  absl::StatusOr<std::vector<v1::JobState>> states = ParseStateList(absl::GetFlag(FLAGS_state));
  if (!states.ok()) return UsageError(absl::StrCat("--state: ", states.status().message()));
  const absl::Duration interval = absl::GetFlag(FLAGS_interval);
  if (interval <= absl::ZeroDuration()) return UsageError("--interval must be positive");
  if (absl::GetFlag(FLAGS_timeout) <= absl::ZeroDuration()) {
    return UsageError("--timeout must be positive");
  }

  absl::StatusOr<SecurityOptions> security = SecurityFromFlags();
  if (!security.ok()) return UsageError(security.status().message());
  std::string target = absl::GetFlag(FLAGS_controller);
  if (target.empty()) {
    const char* env = std::getenv("OFFLOAD_CONTROLLER");
    target = env != nullptr && *env != '\0' ? env : "127.0.0.1:7070";
  }
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = MakeChannel(target, security->tls);
  if (!channel.ok()) return Fail(channel.status());
  Ctl ctl(*channel, security->client_token, output == "json");

  if (command == "submit") return ctl.Submit(args[0]);
  if (command == "list") return ctl.List(*states);
  if (command == "get") return ctl.Get(args[0]);
  if (command == "watch") return ctl.Watch(args[0], interval);
  if (command == "audit") return ctl.Audit(absl::GetFlag(FLAGS_after));
  if (command == "logs") return ctl.Logs(args[0], absl::GetFlag(FLAGS_follow), interval);
  return ctl.Act(command, args[0], absl::GetFlag(FLAGS_reason));
}

}  // namespace
}  // namespace offload

int main(int argc, char** argv) { return offload::Run(argc, argv); }
