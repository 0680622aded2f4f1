/* ddp_test_proc_run (proc.h): a child command with captured stdout and a deadline.
 *
 * The child runs /bin/sh -c in a new process group with stdout on a pipe and stderr on the
 * given file. The parent reads the pipe with poll() until end of file, waiting at most until
 * the deadline; when the deadline passes first it kills the whole group (the shell and
 * whatever it started, which could otherwise keep the pipe open), drains the pipe and reaps
 * the shell, so nothing outlives the call. */
#include "proc.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int ddp_test_proc_run(const char *cmd, const char *stderr_path, double timeout_s, char **out) {
  int fd[2];
  assert_int_equal(pipe(fd), 0);
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    setpgid(0, 0);
    int e = open(stderr_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (e < 0 || dup2(e, 2) < 0 || dup2(fd[1], 1) < 0) _exit(127);
    execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
    _exit(127);
  }
  setpgid(pid, pid); /* also here: no kill may miss the group because the child is late */
  close(fd[1]);
  size_t len = 0, cap = 1 << 16;
  char *buf = malloc(cap);
  assert_non_null(buf);
  double deadline = now_s() + timeout_s;
  bool timed_out = false;
  for (;;) {
    int wait_ms = timed_out ? -1 : (int)((deadline - now_s()) * 1000.0);
    if (!timed_out && wait_ms <= 0) {
      /* The group is gone after this, so its end of the pipe closes and reading ends. */
      kill(-pid, SIGKILL);
      timed_out = true;
      wait_ms = -1;
    }
    struct pollfd p = {.fd = fd[0], .events = POLLIN};
    int pr = poll(&p, 1, wait_ms);
    if (pr < 0 && errno == EINTR) continue;
    assert_true(pr >= 0);
    if (pr == 0) continue; /* the deadline: handled at the top */
    ssize_t n = read(fd[0], buf + len, cap - len - 1);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    len += (size_t)n;
    if (cap - len < 2) {
      cap *= 2;
      buf = realloc(buf, cap);
      assert_non_null(buf);
    }
  }
  buf[len] = 0;
  close(fd[0]);
  int st = 0;
  pid_t w;
  do w = waitpid(pid, &st, 0);
  while (w < 0 && errno == EINTR);
  assert_int_equal(w, pid);
  if (timed_out) print_error("command killed after %.0f s: %s\n", timeout_s, cmd);
  if (out)
    *out = buf;
  else
    free(buf);
  return (!timed_out && WIFEXITED(st)) ? WEXITSTATUS(st) : -1;
}

int ddp_test_free_port(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) fail_msg("socket: %s", strerror(errno));
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = 0};
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t sl = sizeof sa;
  if (bind(fd, (struct sockaddr *)&sa, sizeof sa) != 0 ||
      getsockname(fd, (struct sockaddr *)&sa, &sl) != 0) {
    int e = errno;
    close(fd);
    fail_msg("bind/getsockname on 127.0.0.1:0: %s", strerror(e));
  }
  close(fd);
  return ntohs(sa.sin_port);
}
