/* ddp_test_mkdtemp and friends, ddp_test_time_scale (cleanup.h).
 *
 * The registry is a fixed table of paths owned by the process that registered them (its
 * pid is kept with each path). Removal runs `rm -rf` through fork and execv, which are
 * async-signal-safe, so the SIGTERM handler can use the same code as the atexit handler.
 * The handler then restores the default action and raises the signal again, so the
 * process still ends the way its parent expects. */
#include "cleanup.h"

#include <errno.h>
#include <ftw.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#define MAX_PATHS 256
#define MAX_PATH_LEN 1024

typedef struct entry {
  volatile sig_atomic_t used;
  pid_t owner;
  char path[MAX_PATH_LEN];
} entry_t;

/* Test-side state: the table must be reachable from atexit and signal handlers. */
static entry_t g_paths[MAX_PATHS];
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_installed;

/* rm -rf path, waiting for it; async-signal-safe. */
static int rm_rf(const char *path) {
  pid_t pid = fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    char *const argv[] = {"rm", "-rf", "--", (char *)path, NULL};
    execv("/bin/rm", argv);
    _exit(127);
  }
  int st = 0;
  while (waitpid(pid, &st, 0) < 0)
    if (errno != EINTR) return -1;
  return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : -1;
}

static void remove_all(void) {
  pid_t me = getpid();
  for (int i = 0; i < MAX_PATHS; i++) {
    if (g_paths[i].used && g_paths[i].owner == me) {
      rm_rf(g_paths[i].path);
      g_paths[i].used = 0;
    }
  }
}

static void on_signal(int sig) {
  int saved = errno;
  remove_all();
  signal(sig, SIG_DFL);
  raise(sig);
  errno = saved;
}

static void install(void) {
  if (g_installed) return;
  g_installed = 1;
  atexit(remove_all);
  const int sigs[] = {SIGTERM, SIGINT, SIGHUP};
  for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++) {
    struct sigaction old;
    /* A handler someone else installed (not the default) stays theirs. */
    if (sigaction(sigs[i], NULL, &old) == 0 && old.sa_handler == SIG_DFL) {
      struct sigaction sa;
      memset(&sa, 0, sizeof sa);
      sa.sa_handler = on_signal;
      sigemptyset(&sa.sa_mask);
      sigaction(sigs[i], &sa, NULL);
    }
  }
}

void ddp_test_remove_at_exit(const char *path) {
  if (strlen(path) >= MAX_PATH_LEN) fail_msg("ddp_test_remove_at_exit: path too long: %s", path);
  pthread_mutex_lock(&g_lock);
  install();
  int slot = -1;
  for (int i = 0; i < MAX_PATHS && slot < 0; i++)
    if (!g_paths[i].used) slot = i;
  /* Full: paths removed by their tests (unlink, rm) no longer need a slot. */
  for (int i = 0; i < MAX_PATHS && slot < 0; i++)
    if (access(g_paths[i].path, F_OK) != 0) slot = i;
  if (slot >= 0) {
    g_paths[slot].owner = getpid();
    snprintf(g_paths[slot].path, MAX_PATH_LEN, "%s", path);
    g_paths[slot].used = 1;
  }
  pthread_mutex_unlock(&g_lock);
  if (slot < 0) fail_msg("ddp_test_remove_at_exit: more than %d live paths (%s)", MAX_PATHS, path);
}

char *ddp_test_mkdtemp(char *tmpl) {
  if (!mkdtemp(tmpl)) fail_msg("mkdtemp(%s): %s", tmpl, strerror(errno));
  ddp_test_remove_at_exit(tmpl);
  return tmpl;
}

static int remove_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
  (void)sb;
  (void)flag;
  (void)ftw;
  return remove(p) != 0 && errno != ENOENT ? -1 : 0;
}

bool ddp_test_remove_now(const char *path) {
  pthread_mutex_lock(&g_lock);
  for (int i = 0; i < MAX_PATHS; i++)
    if (g_paths[i].used && g_paths[i].owner == getpid() && strcmp(g_paths[i].path, path) == 0)
      g_paths[i].used = 0;
  pthread_mutex_unlock(&g_lock);
  /* In this process (no fork per call: the harness removes a directory per spawn). */
  if (nftw(path, remove_entry, 16, FTW_DEPTH | FTW_PHYS) != 0 && errno != ENOENT) return false;
  return access(path, F_OK) != 0;
}

double ddp_test_time_scale(void) {
  const char *e = getenv("DDP_TEST_TIME_SCALE");
  if (e && e[0]) {
    char *end = NULL;
    double v = strtod(e, &end);
    if (end && *end == 0 && v >= 1.0 && v <= 1000.0) return v;
  }
  long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
  if (ncpu < 1) ncpu = 1;
  double load1 = 0.0;
  int running = 0, total = 0;
  FILE *f = fopen("/proc/loadavg", "r");
  if (f) {
    if (fscanf(f, "%lf %*f %*f %d/%d", &load1, &running, &total) != 3) load1 = 0.0;
    fclose(f);
  }
  double load = load1 > running - 1 ? load1 : (double)(running - 1);
  double s = load / (double)ncpu;
  return s < 1.0 ? 1.0 : s;
}
