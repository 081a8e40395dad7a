#include "services/offloadctl/job_format.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/status_macros.h"
#include "google/protobuf/util/json_util.h"

namespace offload {
namespace {

bool Running(v1::JobState state) {
  return state == v1::JOB_STATE_RUNNING || state == v1::JOB_STATE_CHECKPOINTING;
}

std::string RequestName(v1::JobRequest request) {
  return absl::AsciiStrToLower(absl::StripPrefix(v1::JobRequest_Name(request), "JOB_REQUEST_"));
}

// "running", with the pending request and the reason when there are any.
std::string StateWithContext(const v1::Job& job) {
  std::string text = StateName(job.state());
  if (job.request() != v1::JOB_REQUEST_NONE) {
    absl::StrAppend(&text, " (", RequestName(job.request()), " requested)");
  }
  if (!job.reason().empty()) absl::StrAppend(&text, ": ", job.reason());
  return text;
}

}  // namespace

std::string RenderTable(const std::vector<std::vector<std::string>>& rows) {
  size_t columns = 0;
  for (const auto& row : rows) columns = std::max(columns, row.size());
  std::vector<size_t> widths(columns, 0);
  for (const auto& row : rows) {
    for (size_t c = 0; c < row.size(); ++c) widths[c] = std::max(widths[c], row[c].size());
  }
  std::string out;
  for (const auto& row : rows) {
    std::string line;
    for (size_t c = 0; c < columns; ++c) {
      const std::string empty;
      const std::string& cell = c < row.size() ? row[c] : empty;
      line += cell;
      if (c + 1 < columns) line.append(widths[c] - cell.size() + 2, ' ');
    }
    // The last cells of a row may be empty; padding them would leave trailing blanks.
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out += line;
    out += '\n';
  }
  return out;
}

std::string FormatCompactDuration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "-";
  const int64_t total = static_cast<int64_t>(std::llround(seconds));
  if (total < 60) return absl::StrFormat("%ds", total);
  if (total < 3600) return absl::StrFormat("%dm%02ds", total / 60, total % 60);
  if (total < 86400) return absl::StrFormat("%dh%02dm", total / 3600, total % 3600 / 60);
  return absl::StrFormat("%dd%02dh", total / 86400, total % 86400 / 3600);
}

absl::StatusOr<std::vector<v1::JobState>> ParseStateList(absl::string_view text) {
  std::vector<v1::JobState> states;
  for (absl::string_view one : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    OFFLOAD_ASSIGN_OR_RETURN(v1::JobState state, ParseStateName(one));
    states.push_back(state);
  }
  return states;
}

std::string FormatSteps(const v1::JobProgress& progress) {
  if (progress.total_steps() == 0) {
    return progress.step() == 0 ? "-" : absl::StrCat(progress.step());
  }
  return absl::StrCat(progress.step(), "/", progress.total_steps());
}

std::string FormatLoss(float loss) {
  if (loss == 0) return "-";
  if (!std::isfinite(loss)) return absl::StrCat(loss);  // "nan" and "inf" are worth seeing
  return absl::StrFormat("%.4f", loss);
}

std::string FormatRate(double tokens_per_s) {
  if (!(tokens_per_s > 0) || !std::isfinite(tokens_per_s)) return "-";
  if (tokens_per_s < 1e3) return absl::StrFormat("%.0f", tokens_per_s);
  if (tokens_per_s < 1e6) return absl::StrFormat("%.1fk", tokens_per_s / 1e3);
  return absl::StrFormat("%.2fM", tokens_per_s / 1e6);
}

std::string FormatEta(const v1::Job& job) {
  // An ETA left over from before a pause or the end says nothing about now.
  if (!Running(job.state()) || !(job.progress().eta_seconds() > 0)) return "-";
  return FormatCompactDuration(job.progress().eta_seconds());
}

absl::Time ToTime(const google::protobuf::Timestamp& timestamp) {
  return absl::FromUnixSeconds(timestamp.seconds()) + absl::Nanoseconds(timestamp.nanos());
}

std::string FormatTimestamp(const google::protobuf::Timestamp& timestamp, absl::TimeZone zone) {
  if (timestamp.seconds() == 0 && timestamp.nanos() == 0) return "-";
  return absl::FormatTime("%Y-%m-%d %H:%M:%S", ToTime(timestamp), zone);
}

std::vector<std::string> JobTableHeader() {
  return {"ID", "NAME", "STATE", "STEP/TOTAL", "LOSS", "VAL", "TOK/S", "ETA", "AGE"};
}

std::vector<std::string> JobRow(const v1::Job& job, absl::Time now) {
  const v1::JobProgress& progress = job.progress();
  std::string age = "-";
  if (job.has_create_time()) {
    age = FormatCompactDuration(absl::ToDoubleSeconds(now - ToTime(job.create_time())));
  }
  return {job.id(),
          job.spec().name().empty() ? "-" : job.spec().name(),
          StateName(job.state()),
          FormatSteps(progress),
          progress.step() == 0 ? "-" : FormatLoss(progress.loss()),
          FormatLoss(progress.val_loss()),
          FormatRate(progress.tokens_per_s()),
          FormatEta(job),
          age};
}

std::string JobTable(const std::vector<v1::Job>& jobs, absl::Time now) {
  std::vector<std::vector<std::string>> rows = {JobTableHeader()};
  for (const v1::Job& job : jobs) rows.push_back(JobRow(job, now));
  return RenderTable(rows);
}

std::string JobDetails(const v1::Job& job, absl::Time now, absl::TimeZone zone) {
  const v1::JobProgress& progress = job.progress();
  std::vector<std::vector<std::string>> rows;
  rows.push_back({"ID:", job.id()});
  rows.push_back({"Name:", job.spec().name().empty() ? "-" : job.spec().name()});
  rows.push_back({"State:", StateName(job.state())});
  rows.push_back({"Tenant:", job.tenant().empty() ? "default" : job.tenant()});
  std::string priority = absl::StrCat(job.spec().priority());
  if (job.spec().has_preemptible() && !job.spec().preemptible()) {
    absl::StrAppend(&priority, ", not preemptible");
  } else if (job.spec().checkpoint().dir().empty()) {
    absl::StrAppend(&priority, ", not preemptible (no checkpoint.dir)");
  }
  if (job.preemptions() > 0) absl::StrAppend(&priority, ", preempted ", job.preemptions(), "x");
  if (!job.preempted_for().empty()) absl::StrAppend(&priority, " (for ", job.preempted_for(), ")");
  rows.push_back({"Priority:", priority});
  if (job.spec().has_torch()) {
    const v1::TorchSpec& torch = job.spec().torch();
    rows.push_back({"Command:", absl::StrJoin(torch.command(), " ")});
    if (!torch.working_dir().empty()) rows.push_back({"Directory:", torch.working_dir()});
  }
  if (!job.reason().empty()) rows.push_back({"Reason:", job.reason()});
  if (job.request() != v1::JOB_REQUEST_NONE) {
    rows.push_back({"Request:", RequestName(job.request())});
  }
  rows.push_back({"Attempt:", absl::StrCat(job.attempt(), " (restarts ", job.restarts(), " of ",
                                           job.spec().max_restarts(), " allowed)")});
  std::string steps = FormatSteps(progress);
  if (progress.total_steps() > 0) {
    absl::StrAppendFormat(
        &steps, " (%.0f%%)",
        100.0 * static_cast<double>(progress.step()) / static_cast<double>(progress.total_steps()));
  }
  rows.push_back({"Step:", steps});
  rows.push_back({"Loss:", absl::StrCat(progress.step() == 0 ? "-" : FormatLoss(progress.loss()),
                                        " (validation ", FormatLoss(progress.val_loss()), ")")});
  rows.push_back({"Tokens/s:", FormatRate(progress.tokens_per_s())});
  rows.push_back({"ETA:", FormatEta(job)});
  if (progress.loss_scale() > 0)
    rows.push_back({"Loss scale:", absl::StrCat(progress.loss_scale())});
  rows.push_back({"Checkpoint:", progress.last_checkpoint().empty()
                                     ? "none"
                                     : absl::StrCat(progress.last_checkpoint(), " (step ",
                                                    progress.last_checkpoint_step(), ")")});
  const uint32_t ranks = job.spec().parallel().has_ranks() ? job.spec().parallel().ranks() : 1;
  const uint32_t shards =
      job.spec().parallel().has_optimizer_servers() ? job.spec().parallel().optimizer_servers() : 1;
  const v1::ParallelSpec& parallel = job.spec().parallel();
  const int zero_stage = parallel.has_zero_stage() ? parallel.zero_stage() : 2;
  std::string zero =
      job.spec().has_torch() ? ", a torch script" : absl::StrCat(", ZeRO stage ", zero_stage);
  if (zero_stage == 3 && !job.spec().has_torch()) {
    absl::StrAppend(&zero, " (window ",
                    parallel.has_param_window_layers() ? parallel.param_window_layers() : 2,
                    " layers)");
  }
  rows.push_back(
      {"Layout:", absl::StrCat(ranks, " trainer rank(s), ", shards, " optimizer server(s)", zero)});
  if (job.trainer_workers_size() > 0) {
    rows.push_back({"Trainers:", absl::StrJoin(job.trainer_workers(), ", ")});
  }
  if (job.server_workers_size() > 0) {
    rows.push_back({"Servers:", absl::StrJoin(job.server_workers(), ", ")});
  }
  if (job.shard_addresses_size() > 0) {
    rows.push_back({"Shards:", absl::StrJoin(job.shard_addresses(), ", ")});
  }
  auto when = [&](const google::protobuf::Timestamp& t) {
    if (t.seconds() == 0 && t.nanos() == 0) return std::string("-");
    return absl::StrCat(FormatTimestamp(t, zone), " (",
                        FormatCompactDuration(absl::ToDoubleSeconds(now - ToTime(t))), " ago)");
  };
  rows.push_back({"Created:", when(job.create_time())});
  rows.push_back({"Updated:", when(job.update_time())});
  if (progress.has_update_time()) rows.push_back({"Progress at:", when(progress.update_time())});
  return RenderTable(rows);
}

std::string WatchLine(const v1::Job& job) {
  const v1::JobProgress& progress = job.progress();
  std::vector<std::string> parts = {StateWithContext(job)};
  if (job.attempt() > 1) parts.push_back(absl::StrCat("attempt ", job.attempt()));
  parts.push_back(absl::StrCat("step ", FormatSteps(progress)));
  if (progress.step() > 0) parts.push_back(absl::StrCat("loss ", FormatLoss(progress.loss())));
  if (progress.val_loss() != 0) {
    parts.push_back(absl::StrCat("val ", FormatLoss(progress.val_loss())));
  }
  if (progress.tokens_per_s() > 0) {
    parts.push_back(absl::StrCat(FormatRate(progress.tokens_per_s()), " tok/s"));
  }
  if (const std::string eta = FormatEta(job); eta != "-") parts.push_back("ETA " + eta);
  return absl::StrJoin(parts, "  ");
}

std::string AuditLine(const v1::AuditRecord& record, absl::TimeZone zone) {
  const std::string who = record.tenant().empty() ? "(no token)"
                          : record.admin()        ? absl::StrCat(record.tenant(), " (admin)")
                                                  : record.tenant();
  std::string line =
      absl::StrFormat("%-6d  %-19s  %-20s  %-10s  %-12s  %s", record.sequence(),
                      FormatTimestamp(record.time(), zone), who, record.action(),
                      record.job_id().empty() ? "-" : record.job_id(), record.code());
  if (!record.message().empty()) absl::StrAppend(&line, ": ", record.message());
  return line;
}

std::string EventLine(const v1::JobEvent& event, absl::TimeZone zone) {
  // Fixed widths rather than a table: `logs --follow` prints lines as they come.
  return absl::StrFormat("%-19s  %-13s  attempt %-3d  %s", FormatTimestamp(event.time(), zone),
                         StateName(event.state()), event.attempt(), event.message());
}

std::string ToJson(const google::protobuf::Message& message, bool one_line) {
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.add_whitespace = !one_line;
  std::string json;
  // Only a message with an out-of-range enum or invalid UTF-8 can fail; say so in the output
  // rather than printing nothing.
  if (!google::protobuf::util::MessageToJsonString(message, &json, options).ok()) {
    return "{\"error\":\"message cannot be printed as JSON\"}";
  }
  while (!json.empty() && json.back() == '\n') json.pop_back();
  return json;
}

}  // namespace offload
