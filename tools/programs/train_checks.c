/* ddp-train's checks of the data against the model (contract in train_checks.h). */
#include "train_checks.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

char *train_read_file(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  size_t cap = 1 << 14, len = 0;
  char *buf = malloc(cap);
  while (buf) {
    if (len + 1 == cap) {
      char *t = realloc(buf, cap *= 2);
      if (!t) {
        free(buf);
        buf = NULL;
        break;
      }
      buf = t;
    }
    size_t got = fread(buf + len, 1, cap - 1 - len, f);
    len += got;
    if (!got) {
      buf[len] = 0;
      break;
    }
  }
  fclose(f);
  return buf;
}

const char *train_why(ddp_status_t st, const ddp_error_t *err) {
  return err && err->msg[0] ? err->msg : ddp_status_str(st);
}

static int ends_with_csv(const char *s) {
  size_t n = strlen(s);
  return n >= 4 && !strcasecmp(s + n - 4, ".csv");
}

/* "line L" for a CSV (header on line 1, blank lines only at the end), else "sample i". */
static void row_name(char *buf, size_t cap, const char *src, int64_t i) {
  if (ends_with_csv(src)) {
    snprintf(buf, cap, "line %" PRId64, i + 2);
  } else {
    snprintf(buf, cap, "sample %" PRId64 " (labels[%" PRId64 "])", i, i);
  }
}

int train_check_default_features(const char *src, const ddp_dataset_t *ds) {
  ddp_dtype_t dt = ddp_dataset_spec(ds)->feature_dtype;
  if (dt == DDP_F32 || dt == DDP_F64) return 0;
  fprintf(stderr,
          "ddp-train: --data %s: the features are %s; the default model (an MLP) takes f32 or "
          "f64 features: convert them, or give a --model that takes %s inputs (an embedding "
          "first)\n",
          src, ddp_dtype_name(dt), ddp_dtype_name(dt));
  return 2;
}

int train_check_labels(const char *src, const ddp_dataset_t *ds, int64_t classes,
                       int64_t *max_label) {
  const ddp_sample_spec_t *sp = ddp_dataset_spec(ds);
  *max_label = -1;
  if (sp->label_dtype != DDP_I64 || sp->label_ndim != 0) return 0;
  int64_t n = ddp_dataset_length(ds), fn = ddp_dataset_feature_numel(ds), one = 1;
  void *f = malloc((size_t)(fn ? fn : 1) * ddp_dtype_size(sp->feature_dtype));
  if (!f) {
    fprintf(stderr, "ddp-train: --data %s: no memory for one sample (%" PRId64 " values)\n", src,
            fn);
    return 2;
  }
  ddp_error_t err = {0};
  int rc = 0;
  for (int64_t i = 0; i < n && !rc; i++) {
    int64_t lab = 0;
    ddp_tensor_t ft, lt;
    ddp_tensor_view(&ft, sp->feature_dtype, 1, &fn, f);
    ddp_tensor_view(&lt, DDP_I64, 1, &one, &lab);
    ddp_status_t st = ddp_dataset_get(ds, i, &ft, &lt, &err);
    if (st != DDP_OK) {
      fprintf(stderr, "ddp-train: --data %s: sample %" PRId64 ": %s\n", src, i,
              train_why(st, &err));
      rc = 2;
      break;
    }
    if (lab == -100) continue; /* cross-entropy's ignore_index */
    char row[64];
    row_name(row, sizeof row, src, i);
    if (lab < 0) {
      fprintf(stderr,
              "ddp-train: --data %s: %s: class label %" PRId64 " is negative (labels are 0, "
              "1, ... or -100 to ignore a sample)\n",
              src, row, lab);
      rc = 2;
    } else if (classes >= 0 && lab >= classes) {
      fprintf(stderr,
              "ddp-train: --data %s: %s: class label %" PRId64 " is out of range for the "
              "model's %" PRId64 " outputs (labels 0..%" PRId64 ")\n",
              src, row, lab, classes, classes - 1);
      rc = 2;
    } else if (classes < 0 && lab >= TRAIN_MAX_DEFAULT_CLASSES) {
      fprintf(stderr,
              "ddp-train: --data %s: %s: class label %" PRId64 " would give the default model "
              "%" PRId64 " outputs (at most %d): fix the label, or give a --model\n",
              src, row, lab, lab + 1, TRAIN_MAX_DEFAULT_CLASSES);
      rc = 2;
    } else if (lab > *max_label) {
      *max_label = lab;
    }
  }
  free(f);
  return rc;
}

int train_model_outputs(const char *model_desc, const char *src, ddp_model_t *m,
                        const ddp_dataset_t *ds, int64_t *outputs) {
  const ddp_sample_spec_t *sp = ddp_dataset_spec(ds);
  int64_t shape[DDP_MAX_DIMS + 1] = {1}, ln = ddp_dataset_label_numel(ds), lab[64];
  *outputs = -1;
  if (ln * (int64_t)ddp_dtype_size(sp->label_dtype) > (int64_t)sizeof lab) return 0;
  memcpy(shape + 1, sp->feature_shape, sizeof(int64_t) * (size_t)sp->feature_ndim);
  ddp_tensor_t f = {0}, l;
  ddp_ctx_t *ctx = NULL;
  ddp_var_t *x = NULL, *y = NULL;
  ddp_error_t err = {0};
  ddp_tensor_view(&l, sp->label_dtype, 1, &ln, lab);
  ddp_status_t st = ddp_tensor_alloc(&f, sp->feature_dtype, sp->feature_ndim + 1, shape);
  if (st == DDP_OK) {
    ddp_tensor_t fv; /* the sample's view: ddp_dataset_get wants the per-sample numel */
    int64_t fn = ddp_dataset_feature_numel(ds);
    ddp_tensor_view(&fv, sp->feature_dtype, 1, &fn, f.data);
    st = ddp_dataset_get(ds, 0, &fv, &l, &err);
  }
  if (st == DDP_OK) st = ddp_ctx_create(&ctx);
  if (st == DDP_OK) st = ddp_var_new(ctx, f.dtype, f.ndim, f.shape, f.data, false, &x);
  if (st == DDP_OK) {
    ddp_ctx_set_grad_enabled(ctx, false);
    ddp_model_train(m, false);
    st = ddp_model_forward(m, ctx, x, 0, &y);
    ddp_model_train(m, true);
    if (st != DDP_OK) ddp_ctx_last_error_copy(ctx, &err);
  }
  if (st == DDP_OK) {
    *outputs = y->value.ndim > 0 ? y->value.shape[y->value.ndim - 1] : 1;
  } else {
    fprintf(stderr, "ddp-train: --model %s on sample 0 of --data %s (%s features): %s\n",
            model_desc, src, ddp_dtype_name(sp->feature_dtype), train_why(st, &err));
  }
  ddp_ctx_destroy(ctx);
  ddp_tensor_free(&f);
  return st == DDP_OK ? 0 : 2;
}
