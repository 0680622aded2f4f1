/* ddp-train's Transformers models and text data (tools/programs/train_text.c; docs/train.md,
 * "Language models and BERT"): the flags of Transformers' example scripts
 * (--model_name_or_path, --block_size of run_clm, --max_seq_length of run_glue) and
 * libddp's sampling flags, the model built from a config.json or a save_pretrained
 * directory, token files and text CSVs turned into datasets, and what rank 0 does after
 * training: save the final model in Transformers' layout and generate a sample.
 *
 * Functions returning int return an exit status: 0 to go on, 2 for a usage error, 1 for
 * bad data; they have printed the message. */
#ifndef DDP_TOOLS_TRAIN_TEXT_H
#define DDP_TOOLS_TRAIN_TEXT_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "ddp.h"

typedef struct train_text {
  /* flags */
  const char *name_or_path;      /* --model_name_or_path DIR: from_pretrained */
  int64_t block_size;            /* --block_size; -1: min(1024, n_positions) */
  int64_t max_seq_length;        /* --max_seq_length; 128 */
  const char *sample_prompt;     /* --sample_prompt; NULL: no sample */
  int64_t sample_top_k;          /* --sample_top_k; 0: greedy */
  int64_t sample_max_new_tokens; /* --sample_max_new_tokens; 64 */
  const char *given[8];          /* the flags above given on the command line, in order */
  int ngiven;
  /* the model, once probed */
  bool hf; /* a Transformers model (GPT-2 or BERT) */
  ddp_model_task_t task;
  ddp_hf_config_t cfg;
  const char *model_desc; /* the file or directory the model came from */
  /* rank 0's sample, decoded (malloc'd; NULL when none) */
  char *sample;
  double sample_s; /* its generation time */
} train_text_t;

#define TRAIN_TEXT_INIT \
  { .block_size = -1, .max_seq_length = 128, .sample_max_new_tokens = 64 }

/* After train_text_probe: a flag of one kind of model given for another (--block_size or
 * --sample_* with BERT, a libddp model or the default MLP; --max_seq_length with GPT-2 or a
 * libddp model) is a usage error naming the flag and the model, as Transformers' scripts
 * refuse arguments their parser does not use. model_path: --model, NULL when absent. */
int train_text_check_flags(const train_text_t *x, const char *model_path);

/* --help lines for these flags. */
void train_text_usage(FILE *f);
/* When name is one of these flags: stores value and returns true, *rc = 0, or 2 after
 * printing what is wrong with the value. Else false. */
bool train_text_flag(train_text_t *x, const char *name, const char *value, int *rc);
/* Whether the model (--model FILE or --model_name_or_path DIR) is a Transformers one;
 * reads its configuration (and, for a directory, checks that it loads). */
int train_text_probe(train_text_t *x, const char *model_path);
/* The dataset of a Transformers model: for a causal LM, --data (default: the shipped
 * corpus) through ddp_tokens_read and ddp_dataset_lm_blocks; for BERT a text CSV through
 * ddp_dataset_from_text_csv. *src receives the path used. */
int train_text_load_data(train_text_t *x, const char **src, ddp_dataset_t **all);
/* The model every rank builds: from_pretrained (--model_name_or_path), else the JSON
 * (a libddp model file or a Transformers config.json) initialised from seed. */
ddp_status_t train_text_build(const train_text_t *x, const char *model_json, uint64_t seed,
                              ddp_model_t **out, ddp_error_t *err);
/* Rank 0 after training: output_dir/config.json + model.safetensors (Trainer.save_model)
 * and, with --sample_prompt, the sample. */
ddp_status_t train_text_finish(train_text_t *x, ddp_model_t *m, const ddp_train_args_t *a,
                               ddp_error_t *err);
/* The summary's extra lines: perplexity, the final model's directory, the sample. */
void train_text_summary(const train_text_t *x, const ddp_train_args_t *a,
                        const ddp_train_result_t *r);
void train_text_free(train_text_t *x);

#endif /* DDP_TOOLS_TRAIN_TEXT_H */
