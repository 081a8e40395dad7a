#include "services/job_controller/tenancy/identities.h"

#include <cmath>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "google/protobuf/util/json_util.h"
#include "jobs/spec/job_spec.h"

namespace offload {
namespace {

// Long enough that guessing is hopeless; what `openssl rand -hex 16` makes is 32.
constexpr size_t kMinTokenLength = 16;
// A tenants file lists tokens for a few teams; anything much larger is a mistake.
constexpr size_t kMaxTenantsFileBytes = 1 << 20;

absl::Status Bad(absl::string_view source, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("tenants file ", source, ": ", what));
}

}  // namespace

const v1::TenantConfig* TenantTable::Find(absl::string_view name) const {
  for (const v1::TenantConfig& tenant : tenants) {
    if (tenant.name() == name) return &tenant;
  }
  return nullptr;
}

absl::StatusOr<TenantTable> ParseTenants(absl::string_view text, absl::string_view source) {
  if (text.size() > kMaxTenantsFileBytes) {
    return Bad(source,
               absl::StrCat(text.size(), " bytes, more than the limit of ", kMaxTenantsFileBytes));
  }
  v1::TenantsFile file;
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = false;
  if (auto s = google::protobuf::util::JsonStringToMessage(std::string(text), &file, options);
      !s.ok()) {
    // The parser's first line says what is wrong; the lines after it quote the text around the
    // error, which may be a token.
    const std::string message(s.message());
    return Bad(source,
               absl::StrCat("not a TenantsFile in JSON: ", message.substr(0, message.find('\n'))));
  }
  TenantTable table;
  std::set<std::string> names;
  std::set<std::string> tokens;
  std::set<std::string> certificate_names;
  for (int i = 0; i < file.tenants_size(); ++i) {
    v1::TenantConfig tenant = file.tenants(i);
    const std::string where = absl::StrCat("tenants[", i, "]");
    if (absl::Status s = ValidateTenantName(absl::StrCat(where, ".name"), tenant.name()); !s.ok()) {
      return Bad(source, s.message());
    }
    if (!names.insert(tenant.name()).second) {
      return Bad(source, absl::StrCat(where, ": tenant ", tenant.name(), " is listed twice"));
    }
    if (!std::isfinite(tenant.weight()) || tenant.weight() < 0) {
      return Bad(source, absl::StrCat(where, ".weight: must be a finite number >= 0"));
    }
    if (tenant.weight() == 0) tenant.set_weight(1.0);
    for (int t = 0; t < tenant.tokens_size(); ++t) {
      const std::string token_where = absl::StrCat(where, ".tokens[", t, "]");
      if (tenant.tokens(t).size() < kMinTokenLength) {
        return Bad(source, absl::StrCat(token_where, ": a token needs at least ", kMinTokenLength,
                                        " characters"));
      }
      if (!tokens.insert(tenant.tokens(t)).second) {
        return Bad(source, absl::StrCat(token_where, ": the same token is listed twice"));
      }
    }
    for (int c = 0; c < tenant.certificate_names_size(); ++c) {
      const std::string name_where = absl::StrCat(where, ".certificate_names[", c, "]");
      if (tenant.certificate_names(c).empty()) {
        return Bad(source, absl::StrCat(name_where, ": empty"));
      }
      if (!certificate_names.insert(tenant.certificate_names(c)).second) {
        return Bad(source, absl::StrCat(name_where, ": '", tenant.certificate_names(c),
                                        "' names two tenants"));
      }
    }
    table.tenants.push_back(std::move(tenant));
  }
  return table;
}

absl::StatusOr<std::unique_ptr<Identities>> Identities::Create(BearerTokens operator_tokens,
                                                               std::string tenants_file) {
  std::unique_ptr<Identities> identities(
      new Identities(std::move(operator_tokens), std::move(tenants_file)));
  {
    absl::MutexLock lock(&identities->mu_);
    identities->table_ = std::make_shared<const TenantTable>();
  }
  if (!identities->tenants_file_.empty()) {
    absl::StatusOr<bool> loaded = identities->Reload();
    if (!loaded.ok()) return loaded.status();
  }
  return identities;
}

std::unique_ptr<Identities> Identities::WithTable(BearerTokens operator_tokens, TenantTable table) {
  std::unique_ptr<Identities> identities(new Identities(std::move(operator_tokens), ""));
  absl::MutexLock lock(&identities->mu_);
  identities->table_ = std::make_shared<const TenantTable>(std::move(table));
  return identities;
}

absl::StatusOr<bool> Identities::Reload() {
  if (tenants_file_.empty()) return false;
  absl::StatusOr<std::string> text = ReadSecretFile(tenants_file_, "tenants file");
  if (!text.ok() && absl::IsNotFound(text.status())) {
    // Not there (yet): a Kubernetes Secret mounted optional, or one being replaced. No tenant is
    // known then, and only the operator's tokens are accepted: failing closed.
    text = std::string();
  }
  absl::StatusOr<TenantTable> parsed = !text.ok()      ? absl::StatusOr<TenantTable>(text.status())
                                       : text->empty() ? TenantTable()
                                                       : ParseTenants(*text, tenants_file_);
  absl::MutexLock lock(&mu_);
  if (parsed.ok()) {
    for (const v1::TenantConfig& tenant : parsed->tenants) {
      for (const std::string& token : tenant.tokens()) {
        if (operator_tokens_.AcceptsToken(token)) {
          parsed = Bad(tenants_file_, absl::StrCat("tenant ", tenant.name(),
                                                   " lists one of the operator's tokens"));
          break;
        }
      }
      if (!parsed.ok()) break;
    }
  }
  if (!parsed.ok()) {
    // Said once per new problem, not at every poll while the file stays bad.
    if (parsed.status().message() == last_error_) return false;
    last_error_ = std::string(parsed.status().message());
    ++reloads_[0];
    return parsed.status();
  }
  last_error_.clear();
  if (*text == last_text_) return false;
  table_ = std::make_shared<const TenantTable>(*std::move(parsed));
  last_text_ = *std::move(text);
  ++reloads_[1];
  return true;
}

std::shared_ptr<const TenantTable> Identities::table() const {
  absl::MutexLock lock(&mu_);
  return table_;
}

uint64_t Identities::reloads(bool ok) const {
  absl::MutexLock lock(&mu_);
  return reloads_[ok ? 1 : 0];
}

Caller Identities::IdentifyToken(absl::string_view token) const {
  const std::shared_ptr<const TenantTable> table = this->table();
  if (operator_tokens_.empty() && table->tenants.empty()) return Caller::Operator();
  if (token.empty()) return Caller();
  Caller caller;
  if (operator_tokens_.AcceptsToken(token)) caller = Caller::Operator();
  // Every token is compared in full, matched or not, so the time says nothing about which one
  // (or which tenant) matched.
  for (const v1::TenantConfig& tenant : table->tenants) {
    for (const std::string& known : tenant.tokens()) {
      if (ConstantTimeEquals(token, known)) {
        caller = Caller{true, tenant.name(), tenant.admin(), false};
      }
    }
  }
  return caller;
}

Caller Identities::IdentifyCertificate(absl::string_view name) const {
  if (name.empty()) return Caller();
  const std::shared_ptr<const TenantTable> table = this->table();
  for (const v1::TenantConfig& tenant : table->tenants) {
    for (const std::string& known : tenant.certificate_names()) {
      if (known == name) return Caller{true, tenant.name(), tenant.admin(), false};
    }
  }
  return Caller();
}

Caller Identities::IdentifyAuthorization(absl::string_view authorization,
                                         absl::string_view certificate_name) const {
  // A token, when there is one, says who calls (a wrong one is refused, not read past).
  const absl::string_view token = BearerOf(authorization);
  if (token.empty() && !certificate_name.empty()) {
    if (Caller caller = IdentifyCertificate(certificate_name); caller.authenticated) return caller;
  }
  return IdentifyToken(token);
}

Caller Identities::Identify(const grpc::ServerContextBase& context) const {
  const std::string token = PresentedBearer(context);
  if (token.empty()) {
    if (Caller caller = IdentifyCertificate(VerifiedPeerName(context)); caller.authenticated) {
      return caller;
    }
  }
  return IdentifyToken(token);
}

}  // namespace offload
