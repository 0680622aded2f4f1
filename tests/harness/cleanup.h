/* Temporary files that a test removes even when it fails, and timing bounds that grow with
 * the machine's load. Both serve one rule of the suite: a test that fails says why and
 * leaves nothing behind, and a test that passes alone passes beside other jobs.
 *
 * Removal. CMocka ends a failed test with a longjmp, past the test's own clean-up. A path
 * made with ddp_test_mkdtemp (or passed to ddp_test_remove_at_exit) is removed when the
 * process that made it exits (atexit) or is stopped by SIGTERM, SIGINT or SIGHUP (meson
 * test's timeout sends SIGTERM), unless it was removed before with ddp_test_remove_now.
 * A forked child that calls exit() removes nothing: only the registering process does.
 *
 * Load. ddp_test_time_scale() is a factor >= 1 for the upper bounds of timed assertions
 * ("answered within X ms"): the CPUs' load (the one-minute load average or, when higher,
 * the number of threads runnable right now, less this one) divided by the number of
 * online CPUs, or DDP_TEST_TIME_SCALE when that is set to a number >= 1. Lower bounds
 * ("not before the timeout") never scale: load cannot make a timer fire early. */
#ifndef DDP_TEST_CLEANUP_H
#define DDP_TEST_CLEANUP_H

#include <stdbool.h>

/* mkdtemp(tmpl) registered for removal at exit; tmpl ends in six 'X'. Fails the test (CMocka)
 * when the directory cannot be made. Returns tmpl. */
char *ddp_test_mkdtemp(char *tmpl);
/* Registers a file or directory tree for removal when this process exits or is stopped.
 * At most 256 paths that still exist; more fail the test. */
void ddp_test_remove_at_exit(const char *path);
/* Removes the tree now (rm -rf) and forgets its registration. True when it is gone. */
bool ddp_test_remove_now(const char *path);

/* The factor for timed upper bounds (see above), read afresh on each call. */
double ddp_test_time_scale(void);
/* An upper bound of ms milliseconds, scaled by the load. */
#define DDP_TEST_BOUND_MS(ms) ((double)(ms)*ddp_test_time_scale())

#endif /* DDP_TEST_CLEANUP_H */
