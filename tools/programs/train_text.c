/* ddp-train's Transformers models and text data (contract in train_text.h). */
#include "train_text.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "train_checks.h"

#ifndef DDP_TRAIN_TEXT_DATA
#define DDP_TRAIN_TEXT_DATA "tests/data/kjv_genesis_exodus.txt"
#endif

static int say(int rc, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int say(int rc, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "ddp-train: ");
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
  return rc;
}

void train_text_usage(FILE *f) {
  fprintf(f,
          "  --model_name_or_path DIR  a Transformers model directory (config.json and\n"
          "                     model.safetensors, as save_pretrained writes it)\n"
          "  --block_size N     GPT-2: tokens per training block; default min(1024, n_positions)\n"
          "  --max_seq_length N BERT: CSV texts truncated/padded to N tokens; default 128\n"
          "  --sample_prompt TEXT  GPT-2: after training rank 0 prints a sample from TEXT\n"
          "  --sample_top_k K   0 (default): greedy; K > 0: seeded top-k (--seed)\n"
          "  --sample_max_new_tokens N  tokens generated; default 64\n");
}

static bool parse_i64(const char *v, int64_t lo, int64_t hi, int64_t *out) {
  char *end;
  errno = 0;
  long long n = strtoll(v, &end, 10);
  if (errno || end == v || *end || n < lo || n > hi) return false;
  *out = n;
  return true;
}

/* Remembers that flag `name` (a static string of this file) was given. */
static void given(train_text_t *x, const char *name) {
  for (int i = 0; i < x->ngiven; i++)
    if (!strcmp(x->given[i], name)) return;
  if (x->ngiven < (int)(sizeof x->given / sizeof *x->given)) x->given[x->ngiven++] = name;
}

int train_text_check_flags(const train_text_t *x, const char *model_path) {
  bool lm = x->hf && x->task == DDP_TASK_CAUSAL_LM;
  bool bert = x->hf && !lm;
  const char *model = x->hf        ? (lm ? "GPT-2, a causal language model" : "BERT, a classifier")
                      : model_path ? "a libddp model file"
                                   : "the default MLP";
  for (int i = 0; i < x->ngiven; i++) {
    const char *f = x->given[i];
    bool for_lm = strcmp(f, "max_seq_length") != 0; /* block_size and sample_* */
    if (for_lm ? lm : bert) continue;
    return say(2,
               "--%s applies to %s, but the model (%s) is %s; Transformers' scripts refuse an "
               "argument they do not use, and so does ddp-train%s",
               f,
               for_lm ? "GPT-2 (run_clm's text blocks and the sample after training)"
                      : "BERT (run_glue's CSV texts)",
               x->model_desc ? x->model_desc
               : model_path  ? model_path
                             : "no --model",
               model,
               lm                                 ? " (GPT-2's sequence length is --block_size)"
               : bert && !strcmp(f, "block_size") ? " (BERT's sequence length is --max_seq_length)"
                                                  : "");
  }
  return 0;
}

bool train_text_flag(train_text_t *x, const char *name, const char *value, int *rc) {
  *rc = 0;
  struct {
    const char *name;
    int64_t *dst, lo;
  } ints[] = {{"block_size", &x->block_size, 1},
              {"max_seq_length", &x->max_seq_length, 1},
              {"sample_top_k", &x->sample_top_k, 0},
              {"sample_max_new_tokens", &x->sample_max_new_tokens, 0}};
  for (size_t i = 0; i < sizeof ints / sizeof *ints; i++) {
    if (strcmp(name, ints[i].name) != 0) continue;
    given(x, ints[i].name);
    if (!parse_i64(value, ints[i].lo, INT32_MAX, ints[i].dst)) {
      *rc = say(2, "--%s expects an integer >= %lld, got \"%s\"", name, (long long)ints[i].lo,
                value);
    }
    return true;
  }
  if (!strcmp(name, "model_name_or_path")) {
    x->name_or_path = value;
    return true;
  }
  if (!strcmp(name, "sample_prompt")) {
    given(x, "sample_prompt");
    if (!value[0]) *rc = say(2, "--sample_prompt needs at least one character");
    x->sample_prompt = value;
    return true;
  }
  return false;
}

/* A status's exit code: bad data (a corrupt or mismatched file) 1, else usage 2. */
static int exit_code(ddp_status_t st) { return st == DDP_ERR_INVALID_DATA ? 1 : 2; }

static int adopt(train_text_t *x, ddp_model_t *m) {
  x->hf = true;
  x->task = ddp_model_task(m);
  x->cfg = *ddp_model_hf_config(m);
  ddp_model_destroy(m);
  return 0;
}

int train_text_probe(train_text_t *x, const char *model_path) {
  ddp_error_t err = {0};
  ddp_model_t *m = NULL;
  ddp_status_t st;
  if (x->name_or_path) {
    if (model_path) {
      return say(2, "--model and --model_name_or_path both name the model; give one");
    }
    x->model_desc = x->name_or_path;
    if (access(x->name_or_path, R_OK) != 0) {
      return say(2, "--model_name_or_path %s: %s", x->name_or_path, strerror(errno));
    }
    if ((st = ddp_model_from_pretrained(x->name_or_path, DDP_F32, &m, &err)) != DDP_OK) {
      return say(exit_code(st), "--model_name_or_path %s: %s", x->name_or_path, err.msg);
    }
    return adopt(x, m);
  }
  if (!model_path) return 0;
  x->model_desc = model_path;
  char *text = train_read_file(model_path);
  if (!text) return say(2, "--model %s: %s", model_path, strerror(errno));
  cJSON *j = cJSON_Parse(text);
  bool hf = j && cJSON_IsObject(j) && cJSON_GetObjectItemCaseSensitive(j, "model_type");
  cJSON_Delete(j);
  if (!hf) {
    free(text);
    return 0; /* a libddp model file: ddp-train's usual path */
  }
  ddp_hf_config_t cfg;
  st = ddp_hf_config_parse(text, model_path, &cfg, &err);
  free(text);
  if (st == DDP_OK) st = ddp_model_from_hf_config(&cfg, DDP_F32, &m, &err);
  if (st != DDP_OK) return say(2, "--model %s: %s", model_path, err.msg);
  return adopt(x, m);
}

static bool ends_with(const char *s, const char *suffix) {
  size_t a = strlen(s), b = strlen(suffix);
  return a >= b && !strcmp(s + a - b, suffix);
}

/* llm.c's format of a token file by its magic: "GPT-2", "Llama 3", or NULL for another. */
static const char *llmc_format(const char *path) {
  unsigned char m[4] = {0};
  FILE *f = fopen(path, "rb");
  size_t got = f ? fread(m, 1, sizeof m, f) : 0;
  if (f) fclose(f);
  if (got != sizeof m) return NULL;
  int32_t magic = (int32_t)((uint32_t)m[0] | (uint32_t)m[1] << 8 | (uint32_t)m[2] << 16 |
                            (uint32_t)m[3] << 24);
  return magic == DDP_LLMC_MAGIC ? "GPT-2" : magic == DDP_LLMC_MAGIC_U32 ? "Llama 3" : NULL;
}

/* GPT-2 and Llama: a token stream cut into blocks (run_clm's group_texts). */
static int lm_data(train_text_t *x, const char *src, ddp_dataset_t **all) {
  ddp_error_t err = {0};
  bool llama = x->cfg.model_type == DDP_HF_LLAMA;
  int64_t npos = llama ? x->cfg.llama.max_position_embeddings : x->cfg.gpt2.n_positions;
  int64_t vocab = llama ? x->cfg.llama.vocab_size : x->cfg.gpt2.vocab_size;
  if (x->block_size < 0) x->block_size = npos < 1024 ? npos : 1024;
  if (x->block_size > npos) {
    return say(1,
               "--block_size %lld: a sequence of %lld tokens is longer than the model's "
               "%s %lld (%s)",
               (long long)x->block_size, (long long)x->block_size,
               llama ? "max_position_embeddings" : "n_positions", (long long)npos, x->model_desc);
  }
  int64_t *tok = NULL, n = 0;
  ddp_status_t st = ddp_tokens_read(src, &tok, &n, &err);
  if (st != DDP_OK) return say(1, "--data %s: %s", src, err.msg);
  if (n < x->block_size) {
    ddp_tokens_free(tok);
    return say(1, "--data %s: %lld tokens, fewer than one block of --block_size %lld", src,
               (long long)n, (long long)x->block_size);
  }
  st = ddp_dataset_lm_blocks(tok, n, x->block_size, vocab, all, &err);
  ddp_tokens_free(tok);
  if (st != DDP_OK && strstr(err.msg, "outside the vocabulary")) {
    /* A token the model cannot embed: name the model, and a Llama 3 file given to GPT-2. */
    const char *fmt = llmc_format(src);
    bool wrong = fmt && !llama && !strcmp(fmt, "Llama 3");
    return say(1, "--data %s: %s of the model %s (%s)%s", src, err.msg, x->model_desc,
               llama ? "llama" : "gpt2",
               wrong ? "; the file is llm.c's Llama 3 format (magic 20240801, version 7, "
                       "uint32 ids of a Llama 3 tokenizer) and GPT-2 reads llm.c's GPT-2 "
                       "format (magic 20240520, version 1, uint16 ids)"
                     : "");
  }
  if (st != DDP_OK) return say(1, "--data %s: %s", src, err.msg);
  return 0;
}

/* BERT: a text,label CSV, byte-tokenized, truncated and padded (run_glue's padding to
 * max_seq_length). */
static int csv_data(train_text_t *x, const char *src, ddp_dataset_t **all) {
  ddp_error_t err = {0};
  if (!ends_with(src, ".csv")) {
    return say(2,
               "--data %s: sequence classification (%s) trains on a CSV with columns "
               "text,label",
               src, x->model_desc);
  }
  int64_t maxpos = x->cfg.bert.max_position_embeddings;
  if (x->max_seq_length > maxpos) {
    return say(1,
               "--max_seq_length %lld: a sequence of %lld tokens is longer than the "
               "model's max_position_embeddings %lld (%s)",
               (long long)x->max_seq_length, (long long)x->max_seq_length, (long long)maxpos,
               x->model_desc);
  }
  ddp_text_csv_options_t o = DDP_TEXT_CSV_OPTIONS_INIT;
  o.max_length = x->max_seq_length;
  o.pad_token_id = x->cfg.bert.pad_token_id >= 0 ? x->cfg.bert.pad_token_id : 0;
  if (x->cfg.bert.num_labels == 1)
    o.label_dtype = DDP_F32; /* regression: MSE */
  else
    o.num_labels = x->cfg.bert.num_labels; /* every label checked before training */
  ddp_status_t st = ddp_dataset_from_text_csv(src, &o, all, &err);
  if (st != DDP_OK) return say(1, "--data %s: %s", src, err.msg);
  return 0;
}

int train_text_load_data(train_text_t *x, const char **src, ddp_dataset_t **all) {
  if (!*src) *src = DDP_TRAIN_TEXT_DATA;
  if (access(*src, R_OK) != 0) return say(2, "--data %s: %s", *src, strerror(errno));
  return x->task == DDP_TASK_CAUSAL_LM ? lm_data(x, *src, all) : csv_data(x, *src, all);
}

ddp_status_t train_text_build(const train_text_t *x, const char *model_json, uint64_t seed,
                              ddp_model_t **out, ddp_error_t *err) {
  if (x->name_or_path) return ddp_model_from_pretrained(x->name_or_path, DDP_F32, out, err);
  ddp_status_t st = ddp_model_from_json(model_json, out, err);
  if (st == DDP_OK) st = ddp_model_init(*out, seed);
  return st;
}

ddp_status_t train_text_finish(train_text_t *x, ddp_model_t *m, const ddp_train_args_t *a,
                               ddp_error_t *err) {
  if (!x->hf) return DDP_OK;
  int64_t shard;
  ddp_status_t st = ddp_parse_file_size(a->max_shard_size, "--max_shard_size", &shard, err);
  if (st == DDP_OK) st = ddp_model_save_pretrained_sharded(m, a->output_dir, shard, err);
  if (st != DDP_OK) return st;
  if (!x->sample_prompt || x->task != DDP_TASK_CAUSAL_LM) return DDP_OK;
  size_t len = strlen(x->sample_prompt);
  int64_t *ids = malloc((len ? len : 1) * sizeof *ids), *gen = NULL, ngen = 0;
  if (!ids) return DDP_ERR_NO_MEMORY;
  st = ddp_byte_encode(x->sample_prompt, len, ids);
  ddp_generate_options_t o = DDP_GENERATE_OPTIONS_INIT;
  o.max_new_tokens = x->sample_max_new_tokens;
  o.top_k = x->sample_top_k;
  o.seed = a->seed;
  int64_t t0 = ddp_now_ns();
  if (st == DDP_OK) st = ddp_generate(m, ids, (int64_t)len, &o, &gen, &ngen, err);
  x->sample_s = (double)(ddp_now_ns() - t0) * 1e-9;
  if (st == DDP_OK) {
    x->sample = malloc(len + (size_t)ngen + 1);
    if (!x->sample) {
      st = DDP_ERR_NO_MEMORY;
    } else {
      memcpy(x->sample, x->sample_prompt, len);
      st = ddp_byte_decode(gen, ngen, x->sample + len, err);
    }
  }
  ddp_free(gen);
  free(ids);
  return st;
}

void train_text_summary(const train_text_t *x, const ddp_train_args_t *a,
                        const ddp_train_result_t *r) {
  if (!x->hf) return;
  if (x->task == DDP_TASK_CAUSAL_LM && !isnan(r->eval_loss)) {
    printf("ddp-train: eval_loss %.4f, perplexity %.2f\n", r->eval_loss, exp(r->eval_loss));
  }
  printf("ddp-train: final model in %s/ (config.json, model.safetensors: from_pretrained "
         "loads it)\n",
         a->output_dir);
  if (x->sample) {
    char how[64] = "greedy";
    if (x->sample_top_k > 0) {
      snprintf(how, sizeof how, "top-k %lld, seed %llu", (long long)x->sample_top_k,
               (unsigned long long)a->seed);
    }
    printf("ddp-train: sample (%s, %lld new tokens, %.2f s):\n%s\n", how,
           (long long)x->sample_max_new_tokens, x->sample_s, x->sample);
  }
  fflush(stdout);
}

void train_text_free(train_text_t *x) {
  free(x->sample);
  x->sample = NULL;
}
