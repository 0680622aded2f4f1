/* The names of the collective vocabulary of ddp/backend.h (kinds and algorithms), for
 * messages, fingerprints and the flight recorder. */
#include "ddp/backend.h"

const char *ddp_coll_kind_name(ddp_coll_kind_t k) {
  switch (k) {
    case DDP_COLL_ALLREDUCE: return "allreduce";
    case DDP_COLL_BROADCAST: return "broadcast";
    case DDP_COLL_ALLGATHER: return "allgather";
    case DDP_COLL_REDUCE_SCATTER: return "reduce_scatter";
    case DDP_COLL_ALLTOALL: return "alltoall";
    case DDP_COLL_BARRIER: return "barrier";
    case DDP_COLL_SEND: return "send/recv";
    case DDP_COLL_RECV: return "recv";
  }
  return "?";
}

const char *ddp_algorithm_name(ddp_algorithm_t a) {
  switch (a) {
    case DDP_ALGO_AUTO: return "auto";
    case DDP_ALGO_CANONICAL: return "canonical";
    case DDP_ALGO_RING: return "ring";
    case DDP_ALGO_SMALL: return "small";
  }
  return "?";
}
