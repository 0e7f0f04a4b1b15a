// Certificates for mutual TLS tests, issued with the openssl command: a CA, and member or ops certificates that it
// signs (valid as server for 127.0.0.1 and localhost, and as client).
#pragma once

#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "integration/subprocess.h"

namespace epfabric::testing {

struct Pki {
  std::string dir, name, ca, ca_key;
};

inline Pki MakeCa(const std::string& dir, const std::string& name) {
  Pki pki{dir, name, dir + "/" + name + "-ca.pem", dir + "/" + name + "-ca.key"};
  RunResult result = RunBinary(
      {"/bin/sh", "-c",
       absl::StrCat("set -e; cd ", dir, "; openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes ",
                    "-keyout ", pki.ca_key, " -out ", pki.ca, " -days 1 -subj /CN=", name, "-ca 2>/dev/null")});
  EXPECT_EQ(result.exit_code, 0) << result.err;
  return pki;
}

// The files of one certificate: PEM certificate, key and the CA that signed it.
struct IssuedFiles {
  std::string cert, key, ca;
  std::vector<std::string> Flags() const { return {"--tls_cert=" + cert, "--tls_key=" + key, "--tls_ca=" + ca}; }
};

// A certificate for `cn` signed by `pki`, stored as <dir>/<file>.pem and .key.
inline IssuedFiles IssueFiles(const Pki& pki, const std::string& file, const std::string& cn) {
  const std::string base = pki.dir + "/" + file;
  RunResult result = RunBinary(
      {"/bin/sh", "-c",
       absl::StrCat("set -e; openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout ", base,
                    ".key -out ", base, ".csr -subj '/CN=", cn, "' 2>/dev/null;",
                    "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\nextendedKeyUsage=serverAuth,clientAuth\\n' > ",
                    base, ".ext; openssl x509 -req -in ", base, ".csr -CA ", pki.ca, " -CAkey ", pki.ca_key,
                    " -CAcreateserial -out ", base, ".pem -days 1 -extfile ", base, ".ext 2>/dev/null")});
  EXPECT_EQ(result.exit_code, 0) << result.err;
  return {base + ".pem", base + ".key", pki.ca};
}

// The same, as epfabricd's --tls_* flags.
inline std::vector<std::string> Issue(const Pki& pki, const std::string& file, const std::string& cn) {
  return IssueFiles(pki, file, cn).Flags();
}

inline std::string ReadPemFile(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// A channel to a daemon's peer port (`address`, on 127.0.0.1) presenting `files` as a hand-made peer would.
inline std::shared_ptr<grpc::Channel> TlsPeerChannel(const std::string& address, const IssuedFiles& files) {
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = ReadPemFile(files.ca);
  options.pem_private_key = ReadPemFile(files.key);
  options.pem_cert_chain = ReadPemFile(files.cert);
  return grpc::CreateChannel(address, grpc::SslCredentials(options));
}

}  // namespace epfabric::testing
