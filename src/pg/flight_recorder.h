/* Private interface of the flight recorder (docs/errors.md, "Flight recorder"): each group
 * keeps a ring buffer of its last N collectives, written when a collective is queued, started
 * and ended, and dumps it as JSON (PyTorch's flight-recorder field names where they exist)
 * when the group fails, when another rank of the job dumped (the trigger file next to the
 * dumps), on SIGUSR1, and on request.
 *
 * Locking: the recorder has no lock of its own; its group's lock (info.lock) guards it, since
 * the group holds that lock anyway where a collective is queued, taken off the queue and
 * finished, and a lock of its own would cost three more lock pairs per collective, a third
 * of a small collective's bookkeeping. ddp__fr_record, ddp__fr_start and ddp__fr_end are
 * called with it held (a few stores, no allocation, no system call); every other call takes
 * it itself, so none of them may be called with it held, and the dumps format under it and
 * write after releasing it. The
 * process-wide part (the SIGUSR1 handler and the thread that serves it and polls the trigger
 * file) exists only while a recorder with a dump location exists. */
#ifndef DDP_SRC_PG_FLIGHT_RECORDER_H
#define DDP_SRC_PG_FLIGHT_RECORDER_H

#include <pthread.h>

#include "algo/algo.h"

typedef struct ddp__fr ddp__fr_t;

/* A group's identity in the dump. pg_id is the group's creation index on this rank (the k
 * of its store prefix "ddp_pg/<k>"; 0 without a store). */
typedef struct ddp__fr_info {
  int rank;
  int world;
  const char *backend;
  int64_t pg_id;
  int64_t timeout_ms;
  pthread_mutex_t *lock; /* the group's, which guards the recorder (above) */
} ddp__fr_info_t;

/* The recorder of a new group, sized by DDP_FR_BUFFER_SIZE (else TORCH_NCCL_TRACE_BUFFER_SIZE,
 * else 2000). *out = NULL when the size is 0 (recording off): every other call accepts NULL
 * and does nothing. A malformed variable or no memory is an error. */
ddp_status_t ddp__fr_create(const ddp__fr_info_t *info, ddp__fr_t **out, ddp_error_t *err);
void ddp__fr_destroy(ddp__fr_t *fr);

/* The next recorded collective carries this DDP bucket index and text (parameter names,
 * comma-separated; truncated to the entry's capacity). */
void ddp__fr_set_tag(ddp__fr_t *fr, int64_t bucket, const char *text);

/* The recorder's clock: a stamp for ddp__fr_record and ddp__fr_start (0 when fr is NULL).
 * On x86-64 with an invariant TSC it is the TSC, else CLOCK_MONOTONIC ns: a clock_gettime
 * costs about a fifth of a small collective's bookkeeping, and a collective takes three
 * stamps. (The kernel's coarse clock, cheaper still, was tried and dropped: on this loaded
 * VM it lagged by up to 12 ms, and once by 232 ms under ThreadSanitizer.) The dump converts
 * stamps to CLOCK_REALTIME, as PyTorch shows, through the tick rate and the offset between
 * the clocks measured when the recorder was created (a later step of the wall clock, by NTP
 * or by hand, does not move the recorded times). No lock needed. */
int64_t ddp__fr_now(const ddp__fr_t *fr);

/* A collective was queued at stamp `now` (ddp__fr_now): records it (state "scheduled") and
 * returns its record id. This call and the next two: info.lock held. */
uint64_t ddp__fr_record(ddp__fr_t *fr, const ddp__coll_t *c, int64_t now);
/* The bytes this rank sent in every collective recorded so far, in the ring model of
 * ddp_pg_bytes_sent (pg.h). Takes info.lock. */
double ddp__fr_sent_bytes(ddp__fr_t *fr);
/* The collective began running at stamp `now` (state "started"). */
void ddp__fr_start(ddp__fr_t *fr, uint64_t id, int64_t now);
/* The collective ended: st == DDP_OK is state "completed"; otherwise the state stays where it
 * was and the entry keeps the status. */
void ddp__fr_end(ddp__fr_t *fr, uint64_t id, ddp_status_t st);

/* The group failed (the first failure only): records it and writes the dump when a location
 * is configured (reason "timeout", "desync", "peer_failure" or "abort"), then touches the
 * trigger file so the job's other ranks dump too. */
void ddp__fr_on_failure(ddp__fr_t *fr, ddp_status_t st, const char *msg);

/* Writes the dump to path (NULL = the configured location; DDP_ERR_INVALID_USAGE when there is
 * none) through a temporary file and a rename. */
ddp_status_t ddp__fr_dump(ddp__fr_t *fr, const char *path, const char *reason, ddp_error_t *err);

#endif /* DDP_SRC_PG_FLIGHT_RECORDER_H */
