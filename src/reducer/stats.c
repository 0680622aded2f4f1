/* Statistics (§10): get_ddp_logging_data, the communication statistics, the sampled
 * per-iteration timings (iterations 1-10, then every 100th) and the reducer's INFO lines.
 * Nothing here communicates or changes what the reducer computes. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "reducer/reducer_internal.h"

void ddp__ddp_describe_dtypes(ddp_ddp_t *d) {
  size_t len = 0;
  for (size_t i = 0; i < d->P; i++) {
    const char *nm = ddp_dtype_name(d->params[i]->value.dtype);
    if (!strstr(d->dtypes, nm) && len + strlen(nm) + 2 < sizeof d->dtypes)
      len += (size_t)snprintf(d->dtypes + len, sizeof d->dtypes - len, "%s%s", len ? "," : "", nm);
  }
}

void ddp__ddp_log_initialized(const ddp_ddp_t *d) {
  if (!ddp__log_enabled(DDP_LOG_INFO)) return;
  const ddp_ddp_options_t *o = &d->opts;
  ddp__log(d->rank, DDP_LOG_INFO,
           "Reducer initialized with bucket_bytes_cap: %zu first_bucket_bytes_cap: %zu",
           d->bucket_bytes_cap, d->first_bucket_bytes_cap);
  ddp__log(d->rank, DDP_LOG_INFO,
           "DDP Initialized with: world_size: %d rank: %d backend_name: %s "
           "num_parameter_tensors: %zu dtypes: %s bucket_cap_bytes: %zu "
           "first_bucket_bytes: %zu num_buckets: %zu broadcast_buffers: %d "
           "find_unused_parameters: %d gradient_as_bucket_view: %d static_graph: %d "
           "init_sync: %d",
           d->world, d->rank, ddp_pg_backend_name(d->pg), d->P, d->dtypes, d->bucket_bytes_cap,
           d->first_bucket_bytes_cap, d->nbuckets, o->broadcast_buffers, o->find_unused_parameters,
           o->gradient_as_bucket_view, o->static_graph, o->init_sync);
}

void ddp__ddp_layout_free(ddp__layout_t *ls) {
  ddp__free(ls->sizes);
  ddp__free(ls->limits);
  ddp__free(ls->offs);
  ddp__free(ls->idx);
  memset(ls, 0, sizeof *ls);
}

void ddp__ddp_record_layout(ddp_ddp_t *d, ddp__layout_t *ls, const ddp_bucket_assignment_t *a) {
  ddp__ddp_layout_free(ls);
  ls->nb = a->nbuckets;
  ls->sizes = ddp__calloc(a->nbuckets + 1, sizeof(int64_t));
  ls->limits = ddp__calloc(a->nbuckets + 1, sizeof(int64_t));
  ls->offs = ddp__calloc(a->nbuckets + 1, sizeof(size_t));
  ls->idx = ddp__calloc(a->offsets[a->nbuckets] + 1, sizeof(size_t));
  if (!ls->sizes || !ls->limits || !ls->offs || !ls->idx) {
    ls->nb = 0;
    return;
  }
  for (size_t b = 0; b < a->nbuckets; b++) {
    int64_t s = 0;
    for (size_t k = a->offsets[b]; k < a->offsets[b + 1]; k++)
      s += (int64_t)ddp__ddp_pbytes(d->params[a->indices[k]]);
    ls->sizes[b] = s;
    ls->limits[b] = a->limits[b] == SIZE_MAX ? INT64_MAX : (int64_t)a->limits[b];
    ls->offs[b] = a->offsets[b];
  }
  ls->offs[a->nbuckets] = a->offsets[a->nbuckets];
  memcpy(ls->idx, a->indices, a->offsets[a->nbuckets] * sizeof(size_t));
}

void ddp__ddp_stats_sample_end(ddp_ddp_t *d) {
  int64_t it = d->num_iterations;
  if (!(it <= 10 || it % 100 == 0)) return;
  int64_t fwd = d->t_fwd_end - d->t_fwd_start;
  int64_t bwd = d->t_bwd_compute_end - d->t_bwd_start;
  int64_t comm = d->t_comm_start ? d->t_comm_end - d->t_comm_start : 0;
  int64_t ov = d->t_comm_start ? DDP_MAX(0, d->t_bwd_compute_end - d->t_comm_start) : 0;
  d->sum_fwd += fwd;
  d->sum_bwd += bwd;
  d->sum_comm += comm;
  d->sum_overlap += ov;
  d->nsamples++;
  ddp__log(d->rank, DDP_LOG_DETAIL,
           "DDP iteration %" PRId64 ": forward_compute_time=%" PRId64
           " ns backward_compute_time=%" PRId64 " ns backward_comm_time=%" PRId64
           " ns backward_compute_comm_overlap_time=%" PRId64 " ns",
           it, fwd, bwd, comm, ov);
  if (d->has_comm_hook) {
    ddp_ddp_comm_stats_t cs;
    ddp_ddp_get_comm_stats(d, &cs);
    ddp__log(d->rank, DDP_LOG_INFO,
             "DDP iteration %" PRId64 ": comm hook %s: numel before compression %" PRId64
             ", after %" PRId64 ", rate %g, %" PRId64 " bytes all-reduced this step",
             it, d->comm_hook_name, cs.numel_before, cs.numel_after, cs.rate, cs.bytes_last_step);
  }
}

void ddp_ddp_get_logging_data(ddp_ddp_t *d, ddp_ddp_logging_data_t *o) {
  DDP_REQUIRE(d && d->magic == DDP__DDP_MAGIC && o);
  memset(o, 0, sizeof *o);
  o->world_size = d->world;
  o->rank = d->rank;
  o->iteration = d->num_iterations;
  o->backend_name = ddp_pg_backend_name(d->pg);
  o->module_name = "ddp_model";
  o->num_parameter_tensors = d->P;
  for (size_t i = 0; i < d->P; i++)
    o->total_parameter_size_bytes += (int64_t)ddp__ddp_pbytes(d->params[i]);
  o->dtypes = d->dtypes;
  o->broadcast_buffers = d->opts.broadcast_buffers;
  o->find_unused_parameters = d->opts.find_unused_parameters;
  o->gradient_as_bucket_view = d->opts.gradient_as_bucket_view;
  o->static_graph = d->opts.static_graph;
  o->bucket_cap_bytes = (int64_t)d->bucket_bytes_cap;
  o->first_bucket_bytes = (int64_t)d->first_bucket_bytes_cap;
  o->num_initial_buckets = d->initial.nb;
  o->bucket_sizes = d->initial.sizes;
  o->initial_bucket_size_limits = d->initial.limits;
  o->has_rebuilt_buckets = d->has_rebuilt;
  o->num_rebuilt_buckets = d->rebuilt_stats.nb;
  o->rebuilt_bucket_sizes = d->rebuilt_stats.sizes;
  o->rebuilt_bucket_size_limits = d->rebuilt_stats.limits;
  o->rebuilt_per_bucket_param_offsets = d->rebuilt_stats.offs;
  o->rebuilt_per_bucket_param_indices = d->rebuilt_stats.idx;
  o->num_prev_ready_order = d->nprev_ready_order;
  o->prev_iteration_grad_ready_order_indices = d->prev_ready_order;
  o->unused_parameter_size = d->unused_bytes;
  if (d->nsamples) {
    o->avg_forward_compute_time = d->sum_fwd / d->nsamples;
    o->avg_backward_compute_time = d->sum_bwd / d->nsamples;
    o->avg_backward_comm_time = d->sum_comm / d->nsamples;
    o->avg_backward_compute_comm_overlap_time = d->sum_overlap / d->nsamples;
  }
  o->num_runtime_samples = d->nsamples;
  o->comm_hook = d->comm_hook_name ? d->comm_hook_name : "";
  o->join_uneven_inputs = false;
  o->can_set_static_graph = d->opts.find_unused_parameters && !d->opts.static_graph &&
                            d->prev_unused_valid && !d->unused_changed;
}

void ddp_ddp_get_comm_stats(ddp_ddp_t *d, ddp_ddp_comm_stats_t *out) {
  DDP_REQUIRE(d && d->magic == DDP__DDP_MAGIC && out);
  memset(out, 0, sizeof *out);
  if (d->has_comm_hook) {
    if (d->comm_hook.stats) {
      ddp_comm_hook_stats_t s = {0, 0, 0};
      d->comm_hook.stats(d->comm_hook.state, &s);
      out->numel_before = s.numel_before;
      out->numel_after = s.numel_after;
      out->bytes_last_step = s.bytes_last_step;
    }
  } else {
    out->numel_before = out->numel_after = d->comm_numel_total;
    out->bytes_last_step = d->comm_bytes_step;
  }
  out->rate = out->numel_after > 0 ? (double)out->numel_before / (double)out->numel_after : 1.0;
}
