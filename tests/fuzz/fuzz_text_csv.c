/* libFuzzer target for the text classification CSV parser (ddp__text_csv_parse, behind
 * ddp_dataset_from_text_csv). Build and run: docs/fuzzing.md.
 *
 * The options are the defaults but max_length 16, so truncation is reached often. Beyond
 * "no crash, no sanitizer report": an accepted input gives a dataset of at least one
 * sample, each with features I64 [2, 16] whose mask is a run of ones (at least one: texts
 * are never empty) then zeros, whose ids are bytes under the ones and the pad id (0) under
 * the zeros; a rejected one comes with INVALID_DATA or NO_MEMORY, a message naming the
 * input, and no dataset. A violation aborts, which libFuzzer reports. */
#include "data/data_internal.h"

#define FUZZ_TARGET "fuzz_text_csv"
#include "fuzz_common.h"

#define L 16

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  char *copy = (char *)fuzz_copy(data, size);
  ddp_text_csv_options_t o = DDP_TEXT_CSV_OPTIONS_INIT;
  o.max_length = L;
  ddp_dataset_t *ds = (ddp_dataset_t *)&o;
  ddp_error_t err = {0};
  ddp_status_t st = ddp__text_csv_parse("fuzz.csv", copy, size, &o, &ds, &err);
  free(copy);
  if (st != DDP_OK) {
    CHECK(ds == NULL);
    CHECK(st == DDP_ERR_INVALID_DATA || st == DDP_ERR_NO_MEMORY);
    CHECK(err.status == st && strstr(err.msg, "fuzz.csv"));
    return 0;
  }
  int64_t n = ddp_dataset_length(ds);
  CHECK(n >= 1);
  const ddp_sample_spec_t *sp = ddp_dataset_spec(ds);
  CHECK(sp->feature_dtype == DDP_I64 && sp->feature_ndim == 2 && sp->feature_shape[0] == 2 &&
        sp->feature_shape[1] == L && sp->label_dtype == DDP_I64 && sp->label_ndim == 0);
  for (int64_t i = 0; i < n; i++) {
    int64_t fx[2 * L], y;
    ddp_tensor_t f, l;
    int64_t shape[2] = {2, L};
    ddp_tensor_view(&f, DDP_I64, 2, shape, fx);
    ddp_tensor_view(&l, DDP_I64, 0, NULL, &y);
    CHECK(ddp_dataset_get(ds, i, &f, &l, &err) == DDP_OK);
    CHECK(fx[L] == 1);
    int64_t k = 0;
    while (k < L && fx[L + k] == 1) k++;
    for (int64_t j = 0; j < L; j++) {
      if (j < k) {
        CHECK(fx[j] >= 0 && fx[j] <= 255);
      } else {
        CHECK(fx[L + j] == 0 && fx[j] == 0);
      }
    }
  }
  ddp_dataset_destroy(ds);
  return 0;
}
