/* Fingerprint helpers of the algorithm layer: the text and the comparison of the
 * fingerprint every collective carries (algo.h). */
#include <stdio.h>

#include "algo/algo.h"

void ddp__fp_str(const ddp__fp_t *fp, char *buf, size_t n) {
  const char *kind = ddp_coll_kind_name((ddp_coll_kind_t)fp->kind);
  const char *dt = ddp_dtype_name((ddp_dtype_t)fp->dtype);
  char seg[48] = "";
  if (fp->segment) snprintf(seg, sizeof seg, ", segment %llu", (unsigned long long)fp->segment);
  switch (fp->kind) {
    case DDP_COLL_ALLREDUCE:
      snprintf(buf, n, "%s #%llu (%s, %s, count %llu, %s%s)", kind, (unsigned long long)fp->seq,
               ddp_redop_name((ddp_redop_t)fp->op), dt, (unsigned long long)fp->count,
               ddp_algorithm_name((ddp_algorithm_t)fp->algo), seg);
      break;
    case DDP_COLL_REDUCE_SCATTER:
      snprintf(buf, n, "%s #%llu (%s, %s, count %llu%s)", kind, (unsigned long long)fp->seq,
               ddp_redop_name((ddp_redop_t)fp->op), dt, (unsigned long long)fp->count, seg);
      break;
    case DDP_COLL_BROADCAST:
      snprintf(buf, n, "%s #%llu (%s, count %llu, root %d)", kind, (unsigned long long)fp->seq, dt,
               (unsigned long long)fp->count, (int)fp->root);
      break;
    case DDP_COLL_SEND:
      snprintf(buf, n, "%s #%llu of the pair (%s, count %llu, from rank %d)", kind,
               (unsigned long long)fp->seq, dt, (unsigned long long)fp->count, (int)fp->root);
      break;
    case DDP_COLL_BARRIER: snprintf(buf, n, "%s #%llu", kind, (unsigned long long)fp->seq); break;
    default:
      snprintf(buf, n, "%s #%llu (%s, count %llu)", kind, (unsigned long long)fp->seq, dt,
               (unsigned long long)fp->count);
  }
}

bool ddp__fp_equal(const ddp__fp_t *a, const ddp__fp_t *b) {
  return a->seq == b->seq && a->count == b->count && a->kind == b->kind && a->op == b->op &&
         a->dtype == b->dtype && a->root == b->root && a->algo == b->algo &&
         a->segment == b->segment;
}
