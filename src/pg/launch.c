/* Groups from a launcher's environment (torchrun, ddprun, mpirun, srun) and groups of
 * threads (ddp_spawn_threads): the ways to create a group besides ddp_pg_create itself, and
 * built on it. */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "common/common.h"
#include "ddp/pg.h"
#include "pg/pg_internal.h"

static bool env_rank_world(ddp_env_id_t r, ddp_env_id_t w, int *rank, int *world, ddp_status_t *st,
                           ddp_error_t *err) {
  if (!ddp_env_is_set(r) || !ddp_env_is_set(w)) return false;
  int64_t a, b;
  *st = ddp_env_int(w, 1, DDP_PG_MAX_WORLD, &b, err);
  if (*st == DDP_OK) *st = ddp_env_int(r, 0, b - 1, &a, err);
  *rank = (int)a;
  *world = (int)b;
  return true;
}

ddp_status_t ddp_pg_create_from_env(const ddp_pg_options_t *opts, ddp_pg_t **out,
                                    ddp_error_t *err) {
  DDP_REQUIRE(out);
  *out = NULL;
  ddp_pg_options_t o = DDP_PG_OPTIONS_INIT;
  ddp__opts_read(&o, sizeof o, opts);
  ddp_status_t st = DDP_OK;
  if (!env_rank_world(DDP_ENV_RANK, DDP_ENV_WORLD_SIZE, &o.rank, &o.world, &st, err) &&
      !env_rank_world(DDP_ENV_OMPI_RANK, DDP_ENV_OMPI_SIZE, &o.rank, &o.world, &st, err) &&
      !env_rank_world(DDP_ENV_SLURM_PROCID, DDP_ENV_SLURM_NTASKS, &o.rank, &o.world, &st, err))
    return ddp__error(err, -1, DDP_ERR_INVALID_ARGUMENT,
                      "no launcher environment: set RANK and WORLD_SIZE (torchrun, ddprun), or "
                      "run under mpirun (OMPI_COMM_WORLD_*) or srun (SLURM_*)");
  DDP_CHECK(st);
  /* Under mpirun (Open MPI's variables, no RANK) with no backend named, the mpi backend is
   * the natural choice when it was built. */
  bool under_mpirun = !ddp_env_is_set(DDP_ENV_RANK) && ddp_env_is_set(DDP_ENV_OMPI_RANK);
  if (!o.backend)
    o.backend = ddp_env_is_set(DDP_ENV_BACKEND)           ? ddp_env_get(DDP_ENV_BACKEND)
                : under_mpirun && ddp_backend_find("mpi") ? "mpi"
                                                          : "tcp";
  /* Where the named backend's ranks run decides how they meet (a name the list does not
   * have goes on, and ddp_pg_create names the choices). */
  const ddp_backend_info_t *bi = ddp_backend_info(o.backend);
  if (bi && bi->ranks == DDP_RANKS_THREADS)
    return ddp__error(err, o.rank, DDP_ERR_INVALID_ARGUMENT,
                      "backend %s needs all ranks in one process: use ddp_spawn_threads", bi->name);
  /* mpi rendezvouses through MPI itself (mpirun/srun already connected the ranks): no store,
   * so no MASTER_ADDR/MASTER_PORT is needed. */
  if (bi && bi->ranks == DDP_RANKS_MPI) {
    o.store = NULL;
    return ddp_pg_create(&o, out, err);
  }
  int64_t port;
  DDP_CHECK(ddp_env_int(DDP_ENV_MASTER_PORT, 1, 65535, &port, err));
  if (o.timeout_ms < 0) {
    int64_t s;
    DDP_CHECK(ddp_env_int(DDP_ENV_TIMEOUT, 0, INT64_MAX / 1000, &s, err));
    o.timeout_ms = s * 1000;
  }
  ddp_store_options_t so = DDP_STORE_OPTIONS_INIT;
  so.timeout_ms = o.timeout_ms;
  so.job_token = o.job_token;
  so.rank = o.rank;
  ddp_store_t *store = NULL;
  ddp_error_t se = {DDP_OK, ""};
  /* TORCHELASTIC_USE_AGENT_STORE=True: the launcher serves the store (ddprun on node 0, as
   * torchrun's agent does), and rank 0 is one more client of it. */
  bool agent_store = strcmp(ddp_env_get(DDP_ENV_USE_AGENT_STORE), "True") == 0;
  st = ddp_store_create_tcp(ddp_env_get(DDP_ENV_MASTER_ADDR), (int)port,
                            o.rank == 0 && !agent_store, &so, &store, &se);
  if (st != DDP_OK) /* the store has logged it */
    return ddp__error_quiet(err, st, "rank %d: TCP store at %s:%d: %s", o.rank,
                            ddp_env_get(DDP_ENV_MASTER_ADDR), (int)port, se.msg);
  o.store = store;
  st = ddp_pg_create(&o, out, err);
  if (st != DDP_OK) {
    ddp_store_destroy(store);
    return st;
  }
  ddp__pg_own_store(*out, store);
  return DDP_OK;
}

typedef struct spawn_arg {
  int rank;
  ddp_pg_options_t opts;
  ddp_thread_fn fn;
  void *arg;
  ddp_status_t st;
} spawn_arg_t;

static void *spawn_main(void *p) {
  spawn_arg_t *a = p;
  ddp_pg_t *pg = NULL;
  a->opts.rank = a->rank;
  a->st = ddp_pg_create(&a->opts, &pg, NULL);
  if (a->st == DDP_OK) {
    a->st = a->fn(pg, a->arg);
    if (a->st != DDP_OK) {
      char why[96];
      snprintf(why, sizeof why, "its rank function returned %s", ddp_status_name(a->st));
      ddp_pg_abort_reason(pg, why); /* no-op when the function aborted it already */
    }
    ddp_pg_destroy(pg);
  }
  return NULL;
}

ddp_status_t ddp_spawn_threads(int world, const ddp_pg_options_t *opts, ddp_thread_fn fn,
                               void *arg) {
  DDP_REQUIRE(fn);
  if (world < 1 || world > DDP_PG_MAX_WORLD)
    return ddp__error(NULL, -1, DDP_ERR_INVALID_ARGUMENT, "world size %d is not in [1, %d]", world,
                      DDP_PG_MAX_WORLD);
  ddp_pg_options_t o = DDP_PG_OPTIONS_INIT;
  ddp__opts_read(&o, sizeof o, opts);
  o.backend = "threads";
  o.world = world;
  ddp_store_options_t so = DDP_STORE_OPTIONS_INIT;
  so.timeout_ms = o.timeout_ms;
  ddp_store_t *store = NULL;
  ddp_status_t st = ddp_store_create_memory(&so, &store, NULL);
  if (st != DDP_OK) return st;
  o.store = store;
  spawn_arg_t *args = ddp__calloc((size_t)world, sizeof *args);
  pthread_t *th = ddp__calloc((size_t)world, sizeof *th);
  if (!args || !th) {
    st = ddp__error(NULL, -1, DDP_ERR_NO_MEMORY, "ddp_spawn_threads");
    goto out;
  }
  int started = 0;
  for (; started < world; started++) {
    args[started] = (spawn_arg_t){started, o, fn, arg, DDP_OK};
    if (pthread_create(&th[started], NULL, spawn_main, &args[started]) != 0) {
      st = ddp__error(NULL, -1, DDP_ERR_SYSTEM, "pthread_create for rank %d failed", started);
      ddp_store_cancel(store);
      break;
    }
  }
  for (int i = 0; i < started; i++) {
    pthread_join(th[i], NULL);
    if (st == DDP_OK) st = args[i].st;
  }
out:
  ddp__free(args);
  ddp__free(th);
  ddp_store_destroy(store);
  return st;
}
