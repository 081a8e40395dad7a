// Bearer-token auth and TLS for every gRPC channel and the REST gateway (ARCHITECTURE.md section
// 7). Servers accept a set of tokens and check each call's "authorization: Bearer <token>"; clients
// send one. TLS is optional everywhere; with a CA and require_client_cert it is mutual TLS.
#ifndef OFFLOAD_BASE_SECURITY_SECURITY_H_
#define OFFLOAD_BASE_SECURITY_SECURITY_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/grpcpp.h"

struct ssl_st;  // OpenSSL's SSL

namespace offload {

// The tokens a server accepts. Empty: no authentication (only with --allow_unauthenticated).
class BearerTokens {
 public:
  // One token per line; blank lines and lines starting with '#' are skipped. NOT_FOUND for a
  // missing file, INVALID_ARGUMENT for a file without tokens. The messages never quote a token.
  static absl::StatusOr<BearerTokens> FromFile(const std::string& path);
  void Add(std::string token);
  bool empty() const { return tokens_.empty(); }
  // `authorization` is the whole header or metadata value, "Bearer <token>". The comparison takes
  // the same time whichever byte differs, so timing tells an attacker nothing.
  bool Accepts(absl::string_view authorization) const;
  // The same for the token alone (what PresentedBearer returns).
  bool AcceptsToken(absl::string_view token) const;
  // The first token added (a client's default credential); empty when there is none.
  const std::string& first_token() const;

 private:
  std::vector<std::string> tokens_;
};

// OK when tokens is empty or the call's "authorization" metadata is accepted; otherwise
// UNAUTHENTICATED "missing or invalid bearer token" (no detail about which). Takes the base
// class so that both grpc::ServerContext and grpc::CallbackServerContext work.
grpc::Status CheckBearer(const BearerTokens& tokens, const grpc::ServerContextBase& context);

// Adds "authorization: Bearer <token>" to a client call; nothing when token is empty.
void AttachBearer(grpc::ClientContext* context, const std::string& token);

// The token of a call's "authorization: Bearer <token>" metadata (the first such value); empty
// when the call carries none. For servers that decide per call which token grants what.
std::string PresentedBearer(const grpc::ServerContextBase& context);

// The token of an "authorization" value "Bearer <token>" (scheme case-insensitive); empty when
// the value is not one.
absl::string_view BearerOf(absl::string_view authorization);

// Reads a whole file of secrets (a token or key file). NOT_FOUND names the file and says what it
// was meant to be (`what`); the contents never appear in a message.
absl::StatusOr<std::string> ReadSecretFile(const std::string& path, absl::string_view what);

// The common name (CN) of the client certificate a call's peer presented and TLS verified against
// the server's CA (mutual TLS); empty when there is none. gRPC calls, and the SSL connection of an
// HTTPS request (OpenSSL's SSL; nullptr for plain HTTP).
std::string VerifiedPeerName(const grpc::ServerContextBase& context);
std::string VerifiedPeerName(const ssl_st* ssl);

// Equality whose time does not depend on where a and b differ (only on their lengths), for
// comparing a presented secret with a known one.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b);

// n random bytes from the kernel's generator into out (retrying short reads and EINTR).
absl::Status ReadRandom(void* out, size_t n);
// 128 random bits from the kernel's generator as 32 hex digits: a fresh bearer token.
absl::StatusOr<std::string> RandomToken();
// 256 random bits as raw bytes: a key for DeriveSecret.
absl::StatusOr<std::string> RandomKey();
// HMAC-SHA256(key, label) as 64 hex digits: a secret for one purpose (an attempt's shard job id)
// that whoever holds the key can compute again, and no one else can.
std::string DeriveSecret(absl::string_view key, absl::string_view label);

// The variable in which a trainer rank gets the credential it presents to its optimizer shards
// (its attempt's secret): the environment, never argv, which every user of the host can read.
inline constexpr char kShardTokenEnv[] = "OFFLOAD_SHARD_TOKEN";

struct TlsConfig {
  std::string cert_file;  // PEM chain: a server's certificate, or a client's for mutual TLS
  std::string key_file;   // PEM private key of cert_file
  std::string ca_file;    // PEM roots that verify the peer; a client uses TLS when it is set
  bool require_client_cert = false;  // servers: mutual TLS, clients must present a cert of ca_file
  std::string server_name_override;  // clients: the name the server's certificate must carry
};

// What MakeServerCredentials checks before it builds anything: cert_file with a key_file that
// is its key, a CA file when client certificates are required, every PEM file readable, and no
// TLS-only setting without cert_file. For servers that load the files themselves (the REST
// gateway), so that they report bad files as the gRPC server does. Errors name the file.
absl::Status CheckServerTls(const TlsConfig& tls);
// Insecure credentials when cert_file is empty. Errors name the file that is missing or bad.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsConfig& tls);
// Insecure credentials when ca_file is empty; TLS otherwise, with cert_file/key_file as the
// client certificate when both are set.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsConfig& tls);
// Channel arguments that go with MakeChannelCredentials: the server name override, when set.
grpc::ChannelArguments ChannelArgumentsFor(const TlsConfig& tls);
// A channel to `target` (host:port) with both: what every client of a controller or shard uses.
absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(const std::string& target,
                                                           const TlsConfig& tls);

// What the security flags (security_flags.cc: --token_file, --tls_cert, --tls_key, --tls_ca,
// --tls_client_auth=none|require, --tls_server_name, --allow_unauthenticated) and $OFFLOAD_TOKEN
// say. Every binary that serves or calls a controller links them.
struct SecurityOptions {
  BearerTokens accepted;     // every token of --token_file, plus $OFFLOAD_TOKEN
  std::string client_token;  // what this process sends: $OFFLOAD_TOKEN, else the file's first
  // What a trainer presents to its optimizer shards: $OFFLOAD_SHARD_TOKEN (its attempt's secret,
  // from a pool worker, or the launcher's token), else client_token.
  std::string shard_token;
  TlsConfig tls;
  bool allow_unauthenticated = false;
};
absl::StatusOr<SecurityOptions> SecurityFromFlags();
// FAILED_PRECONDITION when there is no token to accept and no --allow_unauthenticated: what a
// server that must authenticate (the job controller) checks before it starts.
absl::Status RequireTokens(const SecurityOptions& options);
// The same flags as arguments for a child process (the trainer agent starting a rank), so it
// talks to the controller as its parent does. The token travels in the environment, not argv.
std::vector<std::string> SecurityFlagsForChild();

}  // namespace offload

#endif  // OFFLOAD_BASE_SECURITY_SECURITY_H_
