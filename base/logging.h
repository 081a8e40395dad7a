// Logging for the services: the job controller, the optimizer server, and the trainer's pool
// worker and ranks. glog: every line says its severity, date and time to the microsecond, thread
// and file:line, e.g.
//
//   I20261124 11:42:07.125183 23114 server_main.cc:96] cpu_optimizer_server: assigned job ...
//
// and goes to stderr (a container's log, or the launcher's relay), never to files. What a program
// prints for its user or for the programs that start it stays on stdout: the trainer's progress
// and summary, the "listening port=" and "job_controller: grpc ..." lines the launcher reads,
// offloadctl's output.
//
// Why glog: the LOG(severity) << streams and CHECKs of Google-style C++, the same API Abseil's own
// logging later took up (Debian 12's Abseil predates absl/log), with the thread and source line
// that a multi-threaded server's log needs; Debian packages it (libgoogle-glog-dev).
#ifndef OFFLOAD_BASE_LOGGING_H_
#define OFFLOAD_BASE_LOGGING_H_

#include "glog/logging.h"

namespace offload {

// Once, first thing in main(). GLOG_minloglevel=N (0 INFO, 1 WARNING, 2 ERROR) and GLOG_v=N in the
// environment still apply.
void InitLogging(const char* argv0);

}  // namespace offload

#endif  // OFFLOAD_BASE_LOGGING_H_
