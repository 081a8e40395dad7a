// The security flags every serving or controller-calling binary shares (security.h). In a library
// of their own so that binaries which want none of them do not get them in --help.
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/security/security.h"

ABSL_FLAG(std::string, token_file, "",
          "bearer tokens accepted by this server, one per line ('#' comments); a client sends the "
          "first unless $OFFLOAD_TOKEN is set (which is also accepted)");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain: the server's, or the client's for mTLS");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM roots that verify the peer; a client uses TLS when this is set");
ABSL_FLAG(std::string, tls_client_auth, "none",
          "none, or require: servers accept only clients with a certificate of --tls_ca (mTLS)");
ABSL_FLAG(std::string, tls_server_name, "",
          "clients: the name the server's certificate must carry, when not the target's host");
ABSL_FLAG(bool, allow_unauthenticated, false,
          "run without bearer tokens (no --token_file and no $OFFLOAD_TOKEN): anyone who reaches "
          "the port may call");

namespace offload {

absl::StatusOr<SecurityOptions> SecurityFromFlags() {
  SecurityOptions options;
  const std::string token_file = absl::GetFlag(FLAGS_token_file);
  if (!token_file.empty()) {
    absl::StatusOr<BearerTokens> tokens = BearerTokens::FromFile(token_file);
    if (!tokens.ok()) {
      return absl::Status(tokens.status().code(),
                          absl::StrCat("--token_file: ", tokens.status().message()));
    }
    options.accepted = *std::move(tokens);
    options.client_token = options.accepted.first_token();
  }
  if (const char* env = std::getenv("OFFLOAD_TOKEN"); env != nullptr && *env != '\0') {
    options.accepted.Add(env);
    options.client_token = env;
  }
  options.shard_token = options.client_token;
  if (const char* env = std::getenv(kShardTokenEnv); env != nullptr && *env != '\0') {
    options.shard_token = env;
  }
  options.allow_unauthenticated = absl::GetFlag(FLAGS_allow_unauthenticated);

  options.tls.cert_file = absl::GetFlag(FLAGS_tls_cert);
  options.tls.key_file = absl::GetFlag(FLAGS_tls_key);
  options.tls.ca_file = absl::GetFlag(FLAGS_tls_ca);
  options.tls.server_name_override = absl::GetFlag(FLAGS_tls_server_name);
  const std::string client_auth = absl::GetFlag(FLAGS_tls_client_auth);
  if (client_auth != "none" && client_auth != "require") {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_client_auth: expected none or require, got \"", client_auth, "\""));
  }
  options.tls.require_client_cert = client_auth == "require";
  if (options.tls.cert_file.empty() != options.tls.key_file.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key go together: set both or neither");
  }
  if (options.tls.require_client_cert &&
      (options.tls.ca_file.empty() || options.tls.cert_file.empty())) {
    return absl::InvalidArgumentError(
        "--tls_client_auth=require needs --tls_ca (to verify clients) and --tls_cert/--tls_key");
  }
  return options;
}

std::vector<std::string> SecurityFlagsForChild() {
  std::vector<std::string> args;
  auto add_string = [&args](absl::string_view name, const std::string& value) {
    if (!value.empty()) args.push_back(absl::StrCat("--", name, "=", value));
  };
  add_string("token_file", absl::GetFlag(FLAGS_token_file));
  add_string("tls_cert", absl::GetFlag(FLAGS_tls_cert));
  add_string("tls_key", absl::GetFlag(FLAGS_tls_key));
  add_string("tls_ca", absl::GetFlag(FLAGS_tls_ca));
  if (const std::string auth = absl::GetFlag(FLAGS_tls_client_auth); auth != "none") {
    add_string("tls_client_auth", auth);
  }
  add_string("tls_server_name", absl::GetFlag(FLAGS_tls_server_name));
  if (absl::GetFlag(FLAGS_allow_unauthenticated)) args.push_back("--allow_unauthenticated=true");
  return args;
}

absl::Status RequireTokens(const SecurityOptions& options) {
  // Secure by default: a server without tokens must say out loud that it means it.
  if (options.accepted.empty() && !options.allow_unauthenticated) {
    return absl::FailedPreconditionError(
        "no bearer token: give one with --token_file=<file> (one token per line) or "
        "$OFFLOAD_TOKEN, or pass --allow_unauthenticated on a trusted network");
  }
  return absl::OkStatus();
}

}  // namespace offload
