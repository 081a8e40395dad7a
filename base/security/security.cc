#include "base/security/security.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <sys/random.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/status_macros.h"

namespace offload {
namespace {

constexpr absl::string_view kAuthorizationKey = "authorization";
constexpr absl::string_view kBearerScheme = "bearer";

// Reads a whole file. NOT_FOUND names the file (and says what it was meant to be); the contents
// never appear in a message, since token and key files are secrets.
absl::StatusOr<std::string> ReadSmallFile(const std::string& path, absl::string_view what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int err = errno;
    if (err == ENOENT) return absl::NotFoundError(absl::StrCat(what, " ", path, ": not found"));
    return absl::PermissionDeniedError(
        absl::StrCat(what, " ", path, ": cannot open: ", std::strerror(err)));
  }
  std::ostringstream contents;
  contents << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat(what, " ", path, ": read failed"));
  return contents.str();
}

struct BioDeleter {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Deleter {
  void operator()(X509* x) const { X509_free(x); }
};
struct PkeyDeleter {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
using BioPtr = std::unique_ptr<BIO, BioDeleter>;
using X509Ptr = std::unique_ptr<X509, X509Deleter>;
using PkeyPtr = std::unique_ptr<EVP_PKEY, PkeyDeleter>;

// Never prompt on a terminal for the pass phrase of an encrypted key: a service cannot answer.
int NoPassphrase(char*, int, int, void*) { return -1; }

BioPtr MemBio(const std::string& pem) {
  return BioPtr(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
}

// The first certificate of a PEM file, or nullptr. gRPC only finds a bad PEM when the server
// starts or the first call handshakes, with a message that does not name the file, so check here.
X509Ptr FirstCertificate(const std::string& pem) {
  BioPtr bio = MemBio(pem);
  X509Ptr cert(bio ? PEM_read_bio_X509(bio.get(), nullptr, NoPassphrase, nullptr) : nullptr);
  ERR_clear_error();
  return cert;
}

absl::StatusOr<std::string> ReadCertificates(const std::string& path, absl::string_view what) {
  OFFLOAD_ASSIGN_OR_RETURN(std::string pem, ReadSmallFile(path, what));
  if (FirstCertificate(pem) == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " ", path, ": no PEM certificate could be read from it"));
  }
  return pem;
}

// Reads cert_file and key_file and checks that the key is the certificate's.
absl::StatusOr<std::pair<std::string, std::string>> ReadKeyPair(const TlsConfig& tls) {
  if (tls.key_file.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("TLS certificate file ", tls.cert_file, " is set but no key file is"));
  }
  OFFLOAD_ASSIGN_OR_RETURN(std::string cert,
                           ReadCertificates(tls.cert_file, "TLS certificate file"));
  absl::StatusOr<std::string> key = ReadSmallFile(tls.key_file, "TLS key file");
  if (!key.ok()) return key.status();
  BioPtr bio = MemBio(*key);
  PkeyPtr pkey(bio ? PEM_read_bio_PrivateKey(bio.get(), nullptr, NoPassphrase, nullptr) : nullptr);
  ERR_clear_error();
  if (pkey == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "TLS key file ", tls.key_file, ": no unencrypted PEM private key could be read from it"));
  }
  X509Ptr x509 = FirstCertificate(cert);
  const bool matches = X509_check_private_key(x509.get(), pkey.get()) == 1;
  ERR_clear_error();
  if (!matches) {
    return absl::InvalidArgumentError(absl::StrCat(
        "TLS key file ", tls.key_file, " is not the key of certificate file ", tls.cert_file));
  }
  return std::make_pair(std::move(cert), *std::move(key));
}

// The PEM contents a TLS server needs; all empty for a plaintext server.
struct ServerTlsFiles {
  std::string cert;
  std::string key;
  std::string ca;  // only when client certificates are required
};

// Reads and checks the files once, so CheckServerTls and MakeServerCredentials cannot disagree.
absl::StatusOr<ServerTlsFiles> ReadServerTls(const TlsConfig& tls) {
  if (tls.cert_file.empty()) {
    // Settings that only make sense with TLS must not silently give a plaintext server.
    if (!tls.key_file.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("TLS key file ", tls.key_file, " is set but no certificate file is"));
    }
    if (tls.require_client_cert) {
      return absl::InvalidArgumentError(
          "TLS client certificates are required but no server certificate file is set");
    }
    return ServerTlsFiles();
  }
  OFFLOAD_ASSIGN_OR_RETURN(auto pair, ReadKeyPair(tls));  // (cert chain, key)
  ServerTlsFiles files;
  files.cert = std::move(pair.first);
  files.key = std::move(pair.second);
  if (tls.require_client_cert) {
    if (tls.ca_file.empty()) {
      return absl::InvalidArgumentError(
          "TLS client certificates are required but no CA file is set to verify them");
    }
    absl::StatusOr<std::string> ca = ReadCertificates(tls.ca_file, "TLS CA file");
    if (!ca.ok()) return ca.status();
    files.ca = *std::move(ca);
  }
  return files;
}

grpc::Status CheckMetadata(const BearerTokens& tokens,
                           const std::multimap<grpc::string_ref, grpc::string_ref>& metadata) {
  if (tokens.empty()) return grpc::Status::OK;
  auto [begin, end] =
      metadata.equal_range(grpc::string_ref(kAuthorizationKey.data(), kAuthorizationKey.size()));
  for (auto it = begin; it != end; ++it) {
    if (tokens.Accepts(absl::string_view(it->second.data(), it->second.size()))) {
      return grpc::Status::OK;
    }
  }
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "missing or invalid bearer token");
}

}  // namespace

std::string VerifiedPeerName(const grpc::ServerContextBase& context) {
  const std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  // gRPC names the peer from its certificate only after verifying it against the roots.
  if (auth == nullptr || !auth->IsPeerAuthenticated()) return "";
  const std::vector<grpc::string_ref> names = auth->FindPropertyValues("x509_common_name");
  return names.empty() ? "" : std::string(names.front().data(), names.front().size());
}

std::string VerifiedPeerName(const ssl_st* ssl) {
  if (ssl == nullptr || SSL_get_verify_result(ssl) != X509_V_OK) return "";
  X509* cert = SSL_get_peer_certificate(ssl);
  if (cert == nullptr) return "";
  std::string name;
  const X509_NAME* subject = X509_get_subject_name(cert);
  const int at = X509_NAME_get_index_by_NID(subject, NID_commonName, -1);
  if (at >= 0) {
    const ASN1_STRING* data = X509_NAME_ENTRY_get_data(X509_NAME_get_entry(subject, at));
    unsigned char* utf8 = nullptr;
    const int length = ASN1_STRING_to_UTF8(&utf8, data);
    if (length > 0) name.assign(reinterpret_cast<const char*>(utf8), static_cast<size_t>(length));
    OPENSSL_free(utf8);
  }
  X509_free(cert);
  return name;
}

absl::StatusOr<std::string> ReadSecretFile(const std::string& path, absl::string_view what) {
  return ReadSmallFile(path, what);
}

// RFC 6750: credentials = "Bearer" 1*SP b64token; the scheme is case-insensitive (RFC 7235).
absl::string_view BearerOf(absl::string_view authorization) {
  if (authorization.size() <= kBearerScheme.size() ||
      !absl::EqualsIgnoreCase(authorization.substr(0, kBearerScheme.size()), kBearerScheme) ||
      authorization[kBearerScheme.size()] != ' ') {
    return {};
  }
  return absl::StripAsciiWhitespace(authorization.substr(kBearerScheme.size()));
}

absl::StatusOr<BearerTokens> BearerTokens::FromFile(const std::string& path) {
  OFFLOAD_ASSIGN_OR_RETURN(std::string contents, ReadSmallFile(path, "token file"));
  BearerTokens tokens;
  for (absl::string_view line : absl::StrSplit(contents, '\n')) {
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    tokens.Add(std::string(line));
  }
  if (tokens.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("token file ", path, ": no tokens in it"));
  }
  return tokens;
}

void BearerTokens::Add(std::string token) {
  // An empty token would never be accepted (Accepts wants a non-empty one) but would make the
  // set look non-empty, which turns authentication on with no way to pass it.
  if (token.empty()) return;
  tokens_.push_back(std::move(token));
}

const std::string& BearerTokens::first_token() const {
  static const std::string* const kEmpty = new std::string();
  return tokens_.empty() ? *kEmpty : tokens_.front();
}

bool BearerTokens::Accepts(absl::string_view authorization) const {
  return AcceptsToken(BearerOf(authorization));
}

bool BearerTokens::AcceptsToken(absl::string_view presented) const {
  if (presented.empty()) return false;
  // Compare against every token, without stopping at a match, so the time does not say which.
  bool accepted = false;
  for (const std::string& token : tokens_) accepted |= ConstantTimeEquals(presented, token);
  return accepted;
}

grpc::Status CheckBearer(const BearerTokens& tokens, const grpc::ServerContextBase& context) {
  return CheckMetadata(tokens, context.client_metadata());
}

void AttachBearer(grpc::ClientContext* context, const std::string& token) {
  if (token.empty()) return;
  context->AddMetadata(std::string(kAuthorizationKey), absl::StrCat("Bearer ", token));
}

std::string PresentedBearer(const grpc::ServerContextBase& context) {
  const auto& metadata = context.client_metadata();
  auto [begin, end] =
      metadata.equal_range(grpc::string_ref(kAuthorizationKey.data(), kAuthorizationKey.size()));
  for (auto it = begin; it != end; ++it) {
    absl::string_view token = BearerOf(absl::string_view(it->second.data(), it->second.size()));
    if (!token.empty()) return std::string(token);
  }
  return std::string();
}

// Every byte position up to the longer length is visited and the differences are OR-ed together.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  const size_t n = a.size() > b.size() ? a.size() : b.size();
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= x ^ y;
  }
  // volatile keeps the compiler from turning the loop into an early-exit memcmp.
  volatile unsigned char result = diff;
  return result == 0;
}

absl::Status ReadRandom(void* out, size_t n) {
  size_t done = 0;
  while (done < n) {
    const ssize_t got = getrandom(static_cast<char*>(out) + done, n - done, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return absl::ErrnoToStatus(errno, "getrandom");
    done += static_cast<size_t>(got);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> RandomToken() {
  char bytes[16];
  OFFLOAD_RETURN_IF_ERROR(ReadRandom(bytes, sizeof(bytes)));
  return absl::BytesToHexString(absl::string_view(bytes, sizeof(bytes)));
}

absl::StatusOr<std::string> RandomKey() {
  std::string key(32, '\0');
  OFFLOAD_RETURN_IF_ERROR(ReadRandom(key.data(), key.size()));
  return key;
}

std::string DeriveSecret(absl::string_view key, absl::string_view label) {
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int mac_size = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
       reinterpret_cast<const unsigned char*>(label.data()), label.size(), mac, &mac_size);
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(mac), mac_size));
}

absl::Status CheckServerTls(const TlsConfig& tls) { return ReadServerTls(tls).status(); }

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsConfig& tls) {
  OFFLOAD_ASSIGN_OR_RETURN(ServerTlsFiles files, ReadServerTls(tls));
  if (tls.cert_file.empty()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions options(
      tls.require_client_cert ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                              : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  if (tls.require_client_cert) options.pem_root_certs = std::move(files.ca);
  options.pem_key_cert_pairs.push_back({std::move(files.key), std::move(files.cert)});
  return grpc::SslServerCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsConfig& tls) {
  if (tls.ca_file.empty()) return grpc::InsecureChannelCredentials();
  OFFLOAD_ASSIGN_OR_RETURN(std::string ca, ReadCertificates(tls.ca_file, "TLS CA file"));
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = std::move(ca);
  if (!tls.cert_file.empty() && !tls.key_file.empty()) {
    absl::StatusOr<std::pair<std::string, std::string>> pair = ReadKeyPair(tls);
    if (!pair.ok()) return pair.status();
    options.pem_cert_chain = std::move(pair->first);
    options.pem_private_key = std::move(pair->second);
  }
  return grpc::SslCredentials(options);
}

grpc::ChannelArguments ChannelArgumentsFor(const TlsConfig& tls) {
  grpc::ChannelArguments args;
  if (!tls.server_name_override.empty()) args.SetSslTargetNameOverride(tls.server_name_override);
  return args;
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(const std::string& target,
                                                           const TlsConfig& tls) {
  OFFLOAD_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials,
                           MakeChannelCredentials(tls));
  return grpc::CreateCustomChannel(target, credentials, ChannelArgumentsFor(tls));
}

}  // namespace offload
