// Certificates for tests of TLS and mutual TLS: made in memory, so no test depends on files or
// on the openssl command.
#ifndef OFFLOAD_BASE_TESTING_TLS_TEST_UTIL_H_
#define OFFLOAD_BASE_TESTING_TLS_TEST_UTIL_H_

#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <string>

namespace offload {

// A self-signed P-256 certificate and its key, as PEM.
struct Pem {
  std::string cert;
  std::string key;
};

inline std::string BioToString(BIO* bio) {
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio, &data);
  return std::string(data, n);
}

// Valid for an hour; its own issuer, so it is also the CA file that verifies it.
inline Pem MakeSelfSigned(const std::string& common_name) {
  EVP_PKEY* key = EVP_EC_gen("P-256");
  X509* cert = X509_new();
  X509_set_version(cert, 2);
  ASN1_INTEGER_set(X509_get_serialNumber(cert), 1);
  X509_gmtime_adj(X509_getm_notBefore(cert), 0);
  X509_gmtime_adj(X509_getm_notAfter(cert), 3600);
  X509_set_pubkey(cert, key);
  X509_NAME* name = X509_get_subject_name(cert);
  X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC,
                             reinterpret_cast<const unsigned char*>(common_name.c_str()), -1, -1,
                             0);
  X509_set_issuer_name(cert, name);
  X509_sign(cert, key, EVP_sha256());
  Pem pem;
  BIO* bio = BIO_new(BIO_s_mem());
  PEM_write_bio_X509(bio, cert);
  pem.cert = BioToString(bio);
  BIO_free(bio);
  bio = BIO_new(BIO_s_mem());
  PEM_write_bio_PrivateKey(bio, key, nullptr, nullptr, 0, nullptr, nullptr);
  pem.key = BioToString(bio);
  BIO_free(bio);
  X509_free(cert);
  EVP_PKEY_free(key);
  return pem;
}

}  // namespace offload

#endif  // OFFLOAD_BASE_TESTING_TLS_TEST_UTIL_H_
