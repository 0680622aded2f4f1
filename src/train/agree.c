/* The run's start (trainer.h, ddp__train_agree): rank 0 locks output_dir for the run, and
 * the ranks compare what must agree before the first collective of the setup.
 *
 * The lock is flock(2) on output_dir/.ddp-train.lock, which holds the holder's pid: the
 * kernel drops it when the holder's descriptor closes, at teardown or at any exit
 * (a crash, a kill), so the file a dead run leaves behind is no lock at all. A second run
 * on the directory fails at once naming the directory and the pid.
 *
 * The comparison all-gathers, per rank: its start-up status, an FNV-1a digest of the text
 * of every training argument that must agree, and a digest of the model's structure (each
 * parameter's name, dtype, shape and requires_grad: what PyTorch's
 * _verify_params_across_processes compares). The initial values are not compared: as in
 * PyTorch, rank 0's are broadcast. On a difference, the first argument that differs is
 * all-gathered as text, so that every rank's message names it and both values. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>

#include "common/common.h"
#include "train/trainer.h"

#define LOCK_NAME ".ddp-train.lock"
#define TEXT_MAX 256 /* an argument's text in the message */

static uint64_t fnv(uint64_t h, const void *p, size_t n) {
  const unsigned char *b = p;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

static ddp_status_t lock_output(ddp__trainer_t *t) {
  const char *dir = t->a->output_dir;
  char path[DDP_TRAIN_STR_MAX + 32];
  DDP_CHECK(ddp__mkdirs(dir, t->rank, "output_dir", t->err));
  snprintf(path, sizeof path, "%s/" LOCK_NAME, dir);
  int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    return ddp__error(t->err, t->rank, DDP_ERR_SYSTEM, "output_dir %s: open(%s): %s (errno %d)",
                      dir, path, strerror(errno), errno);
  }
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    int e = errno;
    char pid[32] = "";
    ssize_t n = pread(fd, pid, sizeof pid - 1, 0);
    pid[n > 0 ? n : 0] = 0;
    pid[strcspn(pid, "\n")] = 0;
    close(fd);
    if (e == EWOULDBLOCK) {
      return ddp__error(t->err, t->rank, DDP_ERR_INVALID_USAGE,
                        "output_dir %s is in use by another run (pid %s holds %s); give each "
                        "run its own output_dir (overwrite_output_dir does not take a live "
                        "run's directory)",
                        dir, pid[0] ? pid : "not yet written", path);
    }
    return ddp__error(t->err, t->rank, DDP_ERR_SYSTEM, "output_dir %s: flock(%s): %s (errno %d)",
                      dir, path, strerror(e), e);
  }
  char pid[32];
  int n = snprintf(pid, sizeof pid, "%ld\n", (long)getpid());
  if (ftruncate(fd, 0) != 0 || pwrite(fd, pid, (size_t)n, 0) != n) {
    int e = errno;
    close(fd);
    return ddp__error(t->err, t->rank, DDP_ERR_SYSTEM, "output_dir %s: write(%s): %s (errno %d)",
                      dir, path, strerror(e), e);
  }
  t->lock_fd = fd;
  return DDP_OK;
}

void ddp__train_unlock(ddp__trainer_t *t) {
  if (t->lock_fd >= 0) close(t->lock_fd); /* drops the flock; the file stays, unlocked */
  t->lock_fd = -1;
}

static uint64_t structure_digest(ddp_model_t *m) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < ddp_model_num_params(m); i++) {
    const ddp_param_t *p = ddp_model_param(m, i);
    h = fnv(h, p->name, strlen(p->name) + 1);
    h = fnv(h, &p->value.dtype, sizeof p->value.dtype);
    h = fnv(h, &p->value.ndim, sizeof p->value.ndim);
    h = fnv(h, p->value.shape, (size_t)p->value.ndim * sizeof p->value.shape[0]);
    h = fnv(h, &p->requires_grad, sizeof p->requires_grad);
  }
  return h;
}

static ddp_status_t gather(ddp__trainer_t *t, const void *mine, void *all, size_t count,
                           const char *what) {
  ddp_work_t *w = NULL;
  ddp_status_t st = ddp_allgather(t->pg, mine, all, count, DDP_I64, &w);
  if (st == DDP_OK) st = ddp_work_wait_free(w);
  if (st != DDP_OK) {
    ddp_error_t pe;
    ddp_pg_last_error_copy(t->pg, &pe);
    return ddp__error_quiet(t->err, st, "trainer: start-up %s allgather: %s", what, pe.msg);
  }
  return DDP_OK;
}

/* The message for the first difference: slot i of rank r against rank 0's. Argument slots
 * exchange their text first (every rank takes part: all found the same i). */
static ddp_status_t differ(ddp__trainer_t *t, size_t i, int r, const int64_t *all, size_t n) {
  if (i == n - 1) {
    return ddp__error(t->err, t->rank, DDP_ERR_INVALID_USAGE,
                      "the model differs between ranks: its structure (parameter names, "
                      "dtypes, shapes) has digest %016llx on rank 0 and %016llx on rank %d; "
                      "every rank must build the same model",
                      (unsigned long long)all[i], (unsigned long long)all[(size_t)r * n + i], r);
  }
  int64_t mine[TEXT_MAX / 8] = {0};
  int64_t *texts = ddp__calloc((size_t)t->world, sizeof mine);
  if (!texts) return ddp__error(t->err, t->rank, DDP_ERR_NO_MEMORY, "trainer: no memory");
  ddp__train_arg_text(t->a, i - 1, (char *)mine, sizeof mine);
  ((char *)mine)[sizeof mine - 1] = 0;
  ddp_status_t st = gather(t, mine, texts, DDP_ARRAY_LEN(mine), "argument text");
  if (st == DDP_OK) {
    const char *name;
    ddp_train_arg_info(i - 1, &name, NULL, NULL, NULL);
    char *v0 = (char *)texts, *vr = (char *)(texts + (size_t)r * DDP_ARRAY_LEN(mine));
    v0[TEXT_MAX - 1] = vr[TEXT_MAX - 1] = 0;
    st = ddp__error(t->err, t->rank, DDP_ERR_INVALID_USAGE,
                    "training arguments differ between ranks: %s is %s on rank 0 and %s on "
                    "rank %d; every rank must be given the same value",
                    name, v0, vr, r);
  }
  ddp__free(texts);
  return st;
}

ddp_status_t ddp__train_agree(ddp__trainer_t *t) {
  const size_t nargs = ddp_train_arg_count(), n = nargs + 2;
  ddp_status_t local = t->rank == 0 ? lock_output(t) : DDP_OK;
  /* A rank that cannot start returns at once: ddp_train aborts the group with its message,
   * which the peers, waiting in the exchange below, quote (src/train/fail.c). */
  if (t->world == 1 || local != DDP_OK) return local;
  int64_t *mine = ddp__calloc(n, sizeof *mine);
  int64_t *all = ddp__calloc(n * (size_t)t->world, sizeof *all);
  ddp_status_t st = DDP_OK;
  if (!mine || !all) {
    st = ddp__error(t->err, t->rank, DDP_ERR_NO_MEMORY, "trainer: no memory");
    goto out;
  }
  mine[0] = 0; /* slot 0 is unused: a rank that cannot start aborts instead (above) */
  for (size_t i = 0; i < nargs; i++) {
    char text[DDP_TRAIN_STR_MAX + 8];
    bool agree = ddp__train_arg_text(t->a, i, text, sizeof text);
    mine[1 + i] = agree ? (int64_t)fnv(1469598103934665603ull, text, strlen(text)) : 0;
  }
  mine[n - 1] = (int64_t)structure_digest(t->model);
  if ((st = gather(t, mine, all, n, "agreement")) != DDP_OK) goto out;
  for (size_t i = 1; i < n; i++) {
    for (int r = 1; r < t->world; r++) {
      if (all[(size_t)r * n + i] != all[i]) {
        st = differ(t, i, r, all, n);
        goto out;
      }
    }
  }
out:
  ddp__free(mine);
  ddp__free(all);
  return st;
}
