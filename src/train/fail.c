/* ddp_train's failure contract: one rank's own failure ends the whole group at once.
 *
 * A rank that fails alone (a label out of range in its shard, an output directory only rank
 * 0 creates and cannot, an unreadable checkpoint file) would otherwise leave its peers
 * blocked in their next collective until the group's timeout (1800 s by default): thread
 * ranks cannot see each other die, and even a process rank may outlive its failure (a
 * caller that goes on to do other work). So every failure that did not come from the group
 * itself aborts it, with the rank's message as the reason the peers quote. */
#include "train/train_internal.h"

#include "ddp/pg.h"

ddp_status_t ddp_train(ddp_pg_t *pg, ddp_model_t *model, const ddp_dataset_t *train,
                       const ddp_dataset_t *eval, const ddp_train_args_t *args,
                       ddp_train_event_fn ev, void *user, ddp_train_result_t *result,
                       ddp_error_t *err) {
  ddp_error_t local = {0};
  ddp_error_t *e = err ? err : &local;
  ddp_status_t st = ddp__train_run(pg, model, train, eval, args, ev, user, result, e);
  /* A group failure (a peer died, timed out, desync) is already known to every rank. */
  if (st != DDP_OK && ddp_pg_status(pg) == DDP_OK)
    ddp_pg_abort_reason(pg, e->msg[0] ? e->msg : ddp_status_name(st));
  return st;
}
