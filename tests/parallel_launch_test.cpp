// One process per rank (parallel/launch.h): forked ranks, the rendezvous by file and by TCP, the environment,
// failures.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

#include "core/error.h"
#include "parallel/launch.h"

namespace fs = std::filesystem;
using namespace tessera;
using namespace tessera::parallel;

namespace {

fs::path temp_dir(const std::string& tag) {
  const fs::path d = fs::temp_directory_path() / ("tessera_launch_" + tag + "_" + std::to_string(::getpid()));
  fs::create_directories(d);
  return d;
}

std::vector<uint8_t> id_blob() {
  std::vector<uint8_t> b(128);
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<uint8_t>(i * 7 + 3);
  return b;
}

// Each rank checks its environment, receives rank 0's blob and writes "<rank> <world> <ok>" to its file.
int rank_body(const RankEnv& e, const fs::path& dir) {
  const RankEnv from_env = rank_env_from_environment();
  const std::vector<uint8_t> got =
      exchange_root_blob(e, e.rank == 0 ? id_blob() : std::vector<uint8_t>{}, 20);
  std::ofstream(dir / ("rank" + std::to_string(e.rank)))
      << from_env.rank << " " << from_env.world << " " << from_env.local_rank << " " << (got == id_blob());
  return 0;
}

}  // namespace

TEST(Launch, ForkedRanksShareRankZerosBlobThroughAFile) {
  const fs::path dir = temp_dir("file");
  ASSERT_EQ(launch_local_ranks(3, (dir / "rendezvous").string(),
                               [&](const RankEnv& e) { return rank_body(e, dir); }),
            0);
  for (int r = 0; r < 3; ++r) {
    std::ifstream f(dir / ("rank" + std::to_string(r)));
    int rank = -1, world = -1, local = -1, ok = 0;
    f >> rank >> world >> local >> ok;
    EXPECT_EQ(rank, r);
    EXPECT_EQ(world, 3);
    EXPECT_EQ(local, r);
    EXPECT_EQ(ok, 1) << "rank " << r;
  }
  EXPECT_FALSE(fs::exists(dir / "rendezvous"));  // cleaned up
  fs::remove_all(dir);
}

TEST(Launch, RanksShareRankZerosBlobOverTcp) {
  const fs::path dir = temp_dir("tcp");
  const int port = 20000 + static_cast<int>(::getpid() % 20000);
  // The ranks as separate hosts would run them: MASTER_ADDR/MASTER_PORT, no rendezvous file.
  const int rc = launch_local_ranks(3, "", [&](const RankEnv& base) {
    RankEnv e = base;
    e.rendezvous_file.clear();
    e.master_addr = "127.0.0.1";
    e.master_port = port;
    const std::vector<uint8_t> got =
        exchange_root_blob(e, e.rank == 0 ? id_blob() : std::vector<uint8_t>{}, 20);
    std::ofstream(dir / ("rank" + std::to_string(e.rank))) << (got == id_blob());
    return got == id_blob() ? 0 : 3;
  });
  EXPECT_EQ(rc, 0);
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(fs::exists(dir / ("rank" + std::to_string(r))));
  fs::remove_all(dir);
}

TEST(Launch, AFailingRankStopsTheOthersAndIsReported) {
  const fs::path dir = temp_dir("fail");
  const auto t0 = std::chrono::steady_clock::now();
  const int rc = launch_local_ranks(3, (dir / "rendezvous").string(), [](const RankEnv& e) -> int {
    if (e.rank == 1) throw Error("rank 1 has no GPU");
    std::this_thread::sleep_for(std::chrono::seconds(30));  // a rank waiting in a collective for rank 1
    return 0;
  });
  EXPECT_EQ(rc, 1);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10.0);
  fs::remove_all(dir);
}

TEST(Launch, EnvironmentErrors) {
  setenv("RANK", "3", 1);
  setenv("WORLD_SIZE", "2", 1);
  try {
    rank_env_from_environment();
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "RANK=3 is outside [0, WORLD_SIZE=2)");
  }
  setenv("RANK", "x", 1);
  try {
    rank_env_from_environment();
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "RANK=x is not a rank count or index");
  }
  unsetenv("RANK");
  unsetenv("WORLD_SIZE");
  const RankEnv e = rank_env_from_environment();
  EXPECT_EQ(e.rank, 0);
  EXPECT_EQ(e.world, 1);
  RankEnv lonely = e;
  lonely.world = 2;
  lonely.rank = 1;
  lonely.rendezvous_file = (temp_dir("none") / "never").string();
  try {
    exchange_root_blob(lonely, {}, 0.2);
    ADD_FAILURE() << "no error";
  } catch (const Error& err) {
    EXPECT_EQ(std::string(err.what()),
              "rank 1: no rendezvous file " + lonely.rendezvous_file + " from rank 0 within 0 s");
  }
}

// `--gpus N` commands (run_ranks): forked here, or this process is the one rank an external launcher started.
TEST(Launch, RunRanksForksOrRunsTheEnvironmentsRank) {
  unsetenv("WORLD_SIZE");
  unsetenv("OMPI_COMM_WORLD_SIZE");
  unsetenv("RANK");
  EXPECT_FALSE(launched_externally());
  EXPECT_EQ(world_for_gpus(3), 3);
  const fs::path dir = temp_dir("run_ranks");
  EXPECT_EQ(run_ranks(3, [&](const RankEnv& e) { return rank_body(e, dir); }), 0);
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(fs::exists(dir / ("rank" + std::to_string(r)))) << r;

  // Rank 1 of a world of 2 started outside: run_ranks runs the body here, once, with that identity.
  setenv("WORLD_SIZE", "2", 1);
  setenv("RANK", "1", 1);
  setenv("LOCAL_RANK", "1", 1);
  EXPECT_TRUE(launched_externally());
  int calls = 0;
  RankEnv seen;
  EXPECT_EQ(run_ranks(2, [&](const RankEnv& e) {
              ++calls;
              seen = e;
              return 7;
            }),
            7);
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(seen.rank, 1);
  EXPECT_EQ(seen.world, 2);
  EXPECT_EQ(seen.local_rank, 1);
  try {
    world_for_gpus(4);
    ADD_FAILURE() << "no error";
  } catch (const Error& err) {
    EXPECT_STREQ(err.what(), "--gpus 4 but the environment says WORLD_SIZE=2");
  }
  unsetenv("WORLD_SIZE");
  unsetenv("RANK");
  unsetenv("LOCAL_RANK");
  fs::remove_all(dir);
}

namespace {
volatile sig_atomic_t g_rank_got_term = 0;
extern "C" void on_rank_term(int) { g_rank_got_term = 1; }
}  // namespace

// `kill <launcher>` (SIGTERM to `tessera serve --gpus N`): every rank receives it and may shut down in order.
TEST(Launch, TheLauncherPassesSigtermOnToItsRanks) {
  const fs::path dir = temp_dir("sigterm");
  const pid_t launcher = fork();
  ASSERT_GE(launcher, 0);
  if (launcher == 0) {
    const int rc = launch_local_ranks(2, (dir / "rendezvous").string(), [&](const RankEnv& e) -> int {
      signal(SIGTERM, on_rank_term);
      std::ofstream(dir / ("ready" + std::to_string(e.rank))) << "1";
      for (int i = 0; i < 200 && !g_rank_got_term; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
      if (!g_rank_got_term) return 5;
      std::ofstream(dir / ("term" + std::to_string(e.rank))) << "1";
      return 0;
    });
    _exit(rc);
  }
  for (int i = 0; i < 200 && !(fs::exists(dir / "ready0") && fs::exists(dir / "ready1")); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the launcher is in its wait
  ASSERT_EQ(kill(launcher, SIGTERM), 0);
  int status = 0;
  ASSERT_EQ(waitpid(launcher, &status, 0), launcher);
  ASSERT_TRUE(WIFEXITED(status)) << "the launcher died of the signal instead of passing it on";
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_TRUE(fs::exists(dir / "term0"));
  EXPECT_TRUE(fs::exists(dir / "term1"));
  fs::remove_all(dir);
}
