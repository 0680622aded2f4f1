/* ddp-train's checks of the data against the model before any rank starts
 * (tools/programs/train_checks.c; docs/train.md, "Errors"): a bad class label is reported with the
 * data file and its row, not later as a loss error on one rank (or, with the default model,
 * as a model error), and the default model refuses feature dtypes it cannot take.
 *
 * Functions returning int return an exit status: 0 to go on, else 2 (a usage or data
 * error) after printing the message. */
#ifndef DDP_TOOLS_TRAIN_CHECKS_H
#define DDP_TOOLS_TRAIN_CHECKS_H

#include <stdint.h>

#include "ddp.h"

/* The most classes the default model makes: a larger label is taken as a data error. */
#define TRAIN_MAX_DEFAULT_CLASSES (1 << 20)

/* The whole file at path, NUL-terminated (malloc'd; NULL when it cannot be read). */
char *train_read_file(const char *path);

/* The reason to print for a failure: err's message, else the status's description. */
const char *train_why(ddp_status_t st, const ddp_error_t *err);

/* The default model (an MLP) takes F32 or F64 features; others are refused, naming the
 * file and the dtype. */
int train_check_default_features(const char *src, const ddp_dataset_t *ds);

/* Class labels (I64 scalars; other datasets pass): every label must be -100 (ignored) or
 * in [0, classes). classes < 0: the default model, whose classes are max label + 1, at most
 * TRAIN_MAX_DEFAULT_CLASSES. *max_label receives the largest label (-1 when none). A bad
 * label is reported with src and its row (the CSV line, else the sample index). */
int train_check_labels(const char *src, const ddp_dataset_t *ds, int64_t classes,
                       int64_t *max_label);

/* The number of outputs of model m on one sample of ds (eval mode, forward_flags 0): the
 * last dimension of the output. A failing forward is reported naming the model and the
 * data. */
int train_model_outputs(const char *model_desc, const char *src, ddp_model_t *m,
                        const ddp_dataset_t *ds, int64_t *outputs);

#endif /* DDP_TOOLS_TRAIN_CHECKS_H */
