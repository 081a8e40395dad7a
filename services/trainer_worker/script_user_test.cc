#include "services/trainer_worker/script_user.h"

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

TEST(ScriptUserTest, ParsesTheFlags) {
  absl::StatusOr<std::optional<ScriptUsers>> none = ParseScriptUsers("", "");
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());
  absl::StatusOr<std::optional<ScriptUsers>> users = ParseScriptUsers("10002", "10001,20000");
  ASSERT_TRUE(users.ok()) << users.status();
  EXPECT_EQ((*users)->first_uid, 10002u);
  EXPECT_EQ((*users)->groups, (std::vector<gid_t>{10001, 20000}));
  const RunAs worker3 = ScriptUserOf(**users, 3);
  EXPECT_EQ(worker3.uid, 10005u);
  EXPECT_EQ(worker3.gid, 10005u);
  EXPECT_EQ(worker3.groups, (std::vector<gid_t>{10001, 20000}));
}

TEST(ScriptUserTest, RefusesWhatIsNotANonRootId) {
  for (const auto& [user, groups, named] :
       std::vector<std::tuple<std::string, std::string, std::string>>{
           {"0", "", "--script_user=0"},
           {"nobody", "", "--script_user=nobody"},
           {"-5", "", "--script_user=-5"},
           {"4294967295", "", "below 2^31"},
           {"10002", "0", "0 is not"},
           {"10002", "10001,staff", "staff is not"},
           {"", "10001", "--script_groups needs --script_user"}}) {
    absl::StatusOr<std::optional<ScriptUsers>> parsed = ParseScriptUsers(user, groups);
    ASSERT_FALSE(parsed.ok()) << user << " " << groups;
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(parsed.status().message(), named)) << parsed.status();
  }
}

TEST(ScriptUserTest, CredentialFilesAreTheTokenAndTheTlsKey) {
  EXPECT_EQ(CredentialFiles({"--token_file=/t", "--tls_cert=/c.pem", "--tls_key=/k.pem",
                             "--tls_ca=/ca.pem", "--tls_server_name=x"}),
            (std::vector<std::string>{"/t", "/k.pem"}));
}

class ScriptUserFilesTest : public testing::Test {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "switching users needs root here";
    dir_ = std::filesystem::temp_directory_path() /
           ("offload-script-user-" + std::to_string(getpid()));
    std::filesystem::create_directories(dir_);
    chmod(dir_.c_str(), 0755);
  }
  void TearDown() override {
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }
  std::string File(const std::string& name, mode_t mode) {
    const std::string path = (dir_ / name).string();
    std::ofstream(path) << "secret";
    chmod(path.c_str(), mode);
    return path;
  }
  std::filesystem::path dir_;
};

TEST_F(ScriptUserFilesTest, ATokenTheScriptsCanReadStopsTheWorker) {
  const std::string token = File("token", 0400);
  const std::string key = File("key.pem", 0644);
  const ScriptUsers users{20001, {}};
  EXPECT_TRUE(CheckScriptUsers(users, 2, {token}).ok());
  absl::Status readable = CheckScriptUsers(users, 2, {token, key});
  EXPECT_EQ(readable.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(readable.message(), "user 20001 can read " + key)) << readable;
  EXPECT_TRUE(absl::StrContains(readable.message(), "chmod 0400")) << readable;
  EXPECT_FALSE(absl::StrContains(readable.message(), token)) << readable;
}

TEST_F(ScriptUserFilesTest, AGroupTheScriptsShareCounts) {
  const std::string token = File("token", 0440);
  ASSERT_EQ(chown(token.c_str(), 0, 30000), 0);
  EXPECT_TRUE(CheckScriptUsers(ScriptUsers{20001, {}}, 1, {token}).ok());
  EXPECT_EQ(CheckScriptUsers(ScriptUsers{20001, {30000}}, 1, {token}).code(),
            absl::StatusCode::kFailedPrecondition);
}

// In a child process that gave root up: the worker's own uid among the scripts' is refused, and
// so is a worker that cannot switch users, naming the capability.
TEST(ScriptUserTest, AWorkerThatCannotSwitchOrWouldShareItsUidIsRefused) {
  if (geteuid() != 0) GTEST_SKIP() << "giving root up needs root here";
  const pid_t pid = fork();
  if (pid == 0) {
    if (setgid(30000) != 0 || setuid(30000) != 0) _exit(2);
    absl::Status own = CheckScriptUsers(ScriptUsers{29999, {}}, 2, {});
    if (own.ok() || !absl::StrContains(own.message(), "own uid 30000")) _exit(3);
    absl::Status cannot = CheckScriptUsers(ScriptUsers{20001, {}}, 1, {});
    if (cannot.ok() || !absl::StrContains(cannot.message(), "CAP_SETUID")) _exit(4);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "2: could not give root up, 3: own uid, 4: no capability";
}

}  // namespace
}  // namespace offload
