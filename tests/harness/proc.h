/* Running a child command from a test with a deadline: its stdout captured, its stderr
 * left in a file, its exit status returned. Used by tests/harness/parity.c
 * (ddp_test_run_cmd), which serves the parity tests and tests/test_compare.c. */
#ifndef DDP_TEST_PROC_H
#define DDP_TEST_PROC_H

/* Runs `/bin/sh -c cmd` in its own process group: stdout into *out (malloc'd and
 * NUL-terminated; out NULL: discarded), stderr into the file stderr_path (truncated). After
 * timeout_s seconds the whole group is killed. Returns the exit status; -1 when the command
 * did not exit normally (a signal, or the deadline, which it also reports as a CMocka error
 * message). Failing to start it fails the test. */
int ddp_test_proc_run(const char *cmd, const char *stderr_path, double timeout_s, char **out);

/* A TCP port on 127.0.0.1 that the kernel handed out as free: a socket is bound to port 0,
 * the port read back with getsockname, and the socket closed. Another process may take it
 * before the caller binds it, so a caller that passes it on (ddprun --master_port) retries
 * with a fresh port when its run fails to bind. Fails the test when no socket can be made. */
int ddp_test_free_port(void);

#endif /* DDP_TEST_PROC_H */
