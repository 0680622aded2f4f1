/* ddp-train: the main job. Data-parallel training with Hugging Face's TrainingArguments
 * names, checkpoints, metrics, a progress bar and a replica check (docs/train.md).
 *
 *   ddp-train [--threads N] [--model model.json] [--init weights.safetensors] [--data SOURCE]
 *             [--config args.json]
 *             [--<training argument> VALUE | --<training argument>=VALUE] ...
 *   ddprun --nproc_per_node 4 --backend shm ddp-train --max_steps 200
 *
 * Ranks are threads of this process (--threads, the threads backend) or the processes a
 * launcher started (RANK/WORLD_SIZE from ddprun or torchrun, OMPI_COMM_WORLD_* from
 * mpirun, SLURM_PROCID/SLURM_NTASKS from srun; ddp_backend or the launcher's DDP_BACKEND
 * picks the transport, and plain mpirun defaults to the mpi backend when it is built).
 * Every rank builds the model from the same JSON, loads the same data, and calls
 * ddp_train(); rank 0 prints. Exit status: 0 on success, 2 for a
 * usage error (unknown flag, bad value, missing file), 1 when training fails. */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ddp.h"
#include "train_checks.h"
#include "train_text.h"

#ifndef DDP_TRAIN_DATA
#define DDP_TRAIN_DATA "tests/data/digits.safetensors"
#endif

typedef struct tool {
  ddp_train_args_t args;
  const char *model_path; /* NULL: the built-in MLP */
  const char *data;       /* NULL: the shipped digits, else synthetic */
  const char *label_column;
  bool float_labels; /* --label_dtype f32: CSV labels are regression targets */
  const char *init;  /* --init: initial weights (safetensors state_dict) */
  int threads;
  bool print_args;  /* --print_args: print the resolved arguments as JSON and exit */
  char *model_json; /* what every rank builds */
  ddp_dataset_t *all, *train, *eval;
  bool tty;
  int64_t last_draw_ns; /* the bar is redrawn at most every 100 ms */
  /* rank 0's view of the run, for the summary */
  ddp_train_result_t result;
  ddp_status_t status;
  char errmsg[DDP_ERROR_MSG_MAX];
  /* the first rank that failed (-1: none) and its reason, for the summary line */
  _Atomic int failed_rank;
  ddp_status_t failed_status;
  char failed_msg[DDP_ERROR_MSG_MAX];
  int world;
  const char *backend;
  train_text_t text; /* Transformers models and text data (train_text.c) */
} tool_t;

static void usage(FILE *f) {
  fprintf(f,
          "usage: ddp-train [--threads N] [--model model.json] [--data SOURCE] [--config FILE]\n"
          "                 [--<argument> VALUE | --<argument>=VALUE] ...\n"
          "       ddprun --nproc_per_node N --backend shm ddp-train [same flags]\n"
          "\n"
          "Trains a model data-parallel and writes output_dir/{metrics.jsonl, loss.svg,\n"
          "checkpoint-<step>/}. Ranks are threads of this process (--threads N, default 1) or\n"
          "the processes of a launcher (ddprun, mpirun, srun).\n"
          "\n"
          "  --model FILE       model description (docs/nn.md); default: an MLP sized to the data\n"
          "  --data SOURCE      FILE.safetensors (tensors 'features' and 'labels'), FILE.csv\n"
          "                     (column --label_column, default 'label'; --label_dtype i64 for\n"
          "                     classes (default) or f32 for regression), a directory of MNIST\n"
          "                     idx files (train-images-idx3-ubyte, train-labels-idx1-ubyte),\n"
          "                     'synthetic' (10-class Gaussian mixture) or\n"
          "                     'synthetic:regression'; default: the UCI digits shipped in\n"
          "                     tests/data\n"
          "  --init FILE        initial weights: a safetensors state_dict (PyTorch's names),\n"
          "                     loaded by name, strictly (else: PyTorch's default init, seeded)\n"
          "  --config FILE      JSON object of training arguments (command-line flags win)\n"
          "  --threads N        in-process ranks (threads backend)\n"
          "  --print_args       print the resolved training arguments as JSON and exit\n"
          "  --ddp_fault SPEC   fault injection, as DDP_FAULT (docs/errors.md): e.g.\n"
          "                     rank=1,step=5,kind=crash; kinds crash, hang, slow:MS,\n"
          "                     skip_backward, wrong_shape, corrupt_bucket[:after];\n"
          "                     collective=K instead of step=S\n");
  train_text_usage(f);
  fprintf(f, "\n"
             "Training arguments (Hugging Face TrainingArguments names and defaults):\n");
  for (size_t i = 0; i < ddp_train_arg_count(); i++) {
    const char *name, *type, *def, *help;
    ddp_train_arg_info(i, &name, &type, &def, &help);
    fprintf(f, "  --%-30s %-14s %-14s %s\n", name, type, def[0] ? def : "\"\"", help);
  }
  fprintf(f,
          "\n"
          "A custom model and data (docs/train.md, docs/nn.md):\n"
          "  model.json: {\"dtype\": \"f32\", \"layers\": [{\"type\": \"linear\", \"in\": 4, "
          "\"out\": 32},\n"
          "               {\"type\": \"relu\"}, {\"type\": \"linear\", \"in\": 32, \"out\": 3}]}\n"
          "    layer types: linear, relu, gelu, tanh, sigmoid, dropout, layernorm, batchnorm,\n"
          "    embedding, flatten, residual, branch, checkpoint\n"
          "  data.csv:   a header row (x1,x2,x3,x4,label), then one sample per line; integer\n"
          "              labels train a classifier (cross-entropy); with --label_dtype f32 a\n"
          "              regressor (MSE)\n"
          "  ddp-train --threads 4 --model model.json --data data.csv --max_steps 500 \\\n"
          "            --learning_rate 1e-3 --logging_steps 50 --output_dir run1\n"
          "  ddp-train --threads 4 --model model.json --data data.csv --max_steps 1000 \\\n"
          "            --output_dir run1 --resume_from_checkpoint true     (continue run1)\n"
          "\n"
          "Against PyTorch (docs/compare.md): the same job as tools/torch/torch_reference.py, from "
          "its\n"
          "weights, with its defaults and names spelled out, then ddp-compare T L:\n"
          "  ddp-train --threads 2 --model m.json --init T/weights.safetensors --optim sgd \\\n"
          "            --optim_args momentum=0.9 --max_grad_norm 0 \\\n"
          "            --lr_scheduler_type constant --ddp_find_unused_parameters false \\\n"
          "            --forward_flags 1,0 --dump_dir L \\\n"
          "            [--comm_hook power_sgd --power_sgd_init_q T/powersgd_q.safetensors]\n");
}

static int usage_error(const char *fmt, const char *a, const char *b) {
  fprintf(stderr, "ddp-train: ");
  fprintf(stderr, fmt, a, b);
  fprintf(stderr, "\n(ddp-train --help lists every flag)\n");
  return 2;
}

/* Whether a flag given with no value needs one: a field that is not boolean. A name with no
 * field (a boolean of HF's that ddp-train accepts without a field, or an unknown name) is
 * read as "true", and the setter accepts it, refuses it or names it unknown. */
static bool needs_value(const char *name) {
  static const char *const own[] = {"config",
                                    "model",
                                    "data",
                                    "init",
                                    "label_dtype",
                                    "ddp_fault",
                                    "label_column",
                                    "threads",
                                    "model_name_or_path",
                                    "block_size",
                                    "max_seq_length",
                                    "sample_prompt",
                                    "sample_top_k",
                                    "sample_max_new_tokens"};
  for (size_t i = 0; i < sizeof own / sizeof *own; i++) {
    if (!strcmp(own[i], name)) return true;
  }
  for (size_t i = 0; i < ddp_train_arg_count(); i++) {
    const char *n, *type;
    ddp_train_arg_info(i, &n, &type, NULL, NULL);
    if (!strcmp(n, name)) return strcmp(type, "bool") && strcmp(type, "Optional[bool]");
  }
  return false;
}

static int parse_args(tool_t *t, int argc, char **argv) {
  ddp_error_t err = {0};
  int rc = 0;
  /* The config file first, so that flags given on the command line override it. */
  for (int i = 1; i < argc; i++) {
    const char *v = NULL;
    if (!strcmp(argv[i], "--config")) {
      if (i + 1 >= argc) return usage_error("--config needs a file%s%s", "", "");
      v = argv[i + 1];
    } else if (!strncmp(argv[i], "--config=", 9)) {
      v = argv[i] + 9;
    }
    if (v && ddp_train_args_load_json(&t->args, v, &err) != DDP_OK) {
      return usage_error("%s%s", err.msg, "");
    }
  }
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
      usage(stdout);
      exit(0);
    }
    if (strncmp(a, "--", 2) != 0) return usage_error("unexpected argument \"%s\"%s", a, "");
    char name[128];
    const char *eq = strchr(a, '=');
    const char *value;
    size_t nlen = eq ? (size_t)(eq - a - 2) : strlen(a + 2);
    if (nlen == 0 || nlen >= sizeof name) return usage_error("bad flag \"%s\"%s", a, "");
    memcpy(name, a + 2, nlen);
    name[nlen] = 0;
    if (!strcmp(name, "print_args") && !eq) {
      t->print_args = true;
      continue;
    }
    if (eq) {
      value = eq + 1;
    } else if (i + 1 < argc && strncmp(argv[i + 1], "--", 2) != 0) {
      value = argv[++i];
    } else if (!needs_value(name)) {
      value = "true"; /* a bare boolean flag, as HfArgumentParser accepts */
    } else {
      return usage_error("--%s needs a value%s", name, "");
    }
    if (!strcmp(name, "config")) continue;
    if (!strcmp(name, "model")) {
      t->model_path = value;
    } else if (!strcmp(name, "data")) {
      t->data = value;
    } else if (!strcmp(name, "init")) {
      t->init = value;
    } else if (!strcmp(name, "label_dtype")) {
      if (strcmp(value, "i64") && strcmp(value, "f32")) {
        return usage_error("--label_dtype expects i64 or f32, got \"%s\"%s", value, "");
      }
      t->float_labels = !strcmp(value, "f32");
    } else if (!strcmp(name, "ddp_fault")) {
      /* Fault injection (docs/errors.md): checked here, then handed to the library through
       * the one variable it reads, in this process (every rank of a launcher parses it). */
      ddp_fault_t f;
      if (ddp_fault_parse(value, &f, &err) != DDP_OK)
        return usage_error("--ddp_fault \"%s\": %s", value, err.msg);
      setenv("DDP_FAULT", value, 1);
    } else if (!strcmp(name, "label_column")) {
      t->label_column = value;
    } else if (!strcmp(name, "threads")) {
      char *end;
      errno = 0;
      long n = strtol(value, &end, 10);
      if (errno || *end || end == value || n < 1 || n > DDP_PG_MAX_WORLD) {
        return usage_error("--threads expects an integer in [1, 256], got \"%s\"%s", value, "");
      }
      t->threads = (int)n;
    } else if (train_text_flag(&t->text, name, value, &rc)) {
      if (rc) return rc;
    } else if (ddp_train_args_set(&t->args, name, value, &err) != DDP_OK) {
      return usage_error("%s%s", err.msg, "");
    }
  }
  return 0;
}

/* The default model: an MLP from the features to the classes (max label + 1, labels
 * checked by train_check_labels) or the regression outputs. */
static int build_default_model(tool_t *t) {
  const ddp_sample_spec_t *sp = ddp_dataset_spec(t->all);
  int64_t in = ddp_dataset_feature_numel(t->all), out;
  int rc = train_check_default_features(t->data, t->all);
  if (rc) return rc;
  if (sp->label_dtype == DDP_I64 && sp->label_ndim == 0) {
    int64_t maxc = 0;
    if ((rc = train_check_labels(t->data, t->all, -1, &maxc)) != 0) return rc;
    out = (maxc > 0 ? maxc : 0) + 1;
  } else {
    out = ddp_dataset_label_numel(t->all);
  }
  const char *dt = sp->feature_dtype == DDP_F64 ? "f64" : "f32";
  t->model_json = malloc(1024);
  if (!t->model_json) {
    fprintf(stderr, "ddp-train: --model (default): no memory for the model description\n");
    return 1;
  }
  snprintf(t->model_json, 1024,
           "{\"dtype\": \"%s\", \"layers\": [%s"
           "{\"type\": \"linear\", \"in\": %" PRId64 ", \"out\": 128},"
           "{\"type\": \"relu\"},"
           "{\"type\": \"linear\", \"in\": 128, \"out\": 128},"
           "{\"type\": \"relu\"},"
           "{\"type\": \"linear\", \"in\": 128, \"out\": %" PRId64 "}]}",
           dt, sp->feature_ndim > 1 ? "{\"type\": \"flatten\"}," : "", in, out);
  return 0;
}

static bool is_dir(const char *p) {
  struct stat sb;
  return stat(p, &sb) == 0 && S_ISDIR(sb.st_mode);
}

static bool ends_with(const char *s, const char *suffix) {
  size_t a = strlen(s), b = strlen(suffix);
  return a >= b && !strcmp(s + a - b, suffix);
}

/* A corpus that only a causal LM can train on: a .txt or .bin name, or llm.c's token file
 * magic (20240520 GPT-2, 20240801 Llama 3) at the start. */
static bool is_token_corpus(const char *src) {
  if (ends_with(src, ".txt") || ends_with(src, ".bin")) return true;
  unsigned char h[4] = {0};
  FILE *f = fopen(src, "rb");
  if (!f) return false;
  size_t n = fread(h, 1, sizeof h, f);
  fclose(f);
  uint32_t magic = (uint32_t)h[0] | (uint32_t)h[1] << 8 | (uint32_t)h[2] << 16 |
                   (uint32_t)h[3] << 24;
  return n == 4 && (magic == 20240520u || magic == 20240801u);
}

static int load_data(tool_t *t) {
  ddp_error_t err = {0};
  ddp_status_t st;
  const char *src = t->data;
  if (!src && !t->text.hf) src = access(DDP_TRAIN_DATA, R_OK) == 0 ? DDP_TRAIN_DATA : "synthetic";
  if (t->text.hf) { /* GPT-2 or BERT: token files and text CSVs (train_text.c) */
    int rc = train_text_load_data(&t->text, &src, &t->all);
    if (rc) return rc;
    st = DDP_OK;
  } else if (!strcmp(src, "synthetic") || !strcmp(src, "synthetic:mixture")) {
    ddp_synth_mixture_t c = {t->args.seed, 4096, 32, 10, 1.0f};
    st = ddp_dataset_synthetic_mixture(&c, &t->all, &err);
  } else if (!strcmp(src, "synthetic:regression")) {
    ddp_synth_regression_t c = {t->args.seed, 4096, 16, 32, 4, 0.05f};
    st = ddp_dataset_synthetic_regression(&c, &t->all, &err);
  } else if (is_dir(src)) {
    char img[4096], lab[4096];
    snprintf(img, sizeof img, "%s/train-images-idx3-ubyte", src);
    snprintf(lab, sizeof lab, "%s/train-labels-idx1-ubyte", src);
    st = ddp_dataset_from_mnist(img, lab, true, &t->all, &err);
  } else if (ends_with(src, ".csv")) {
    ddp_csv_options_t o = DDP_CSV_OPTIONS_INIT;
    if (t->label_column) o.label_column = t->label_column;
    if (t->float_labels) o.label_dtype = DDP_F32;
    st = ddp_dataset_from_csv(src, &o, &t->all, &err);
  } else if (is_token_corpus(src)) {
    fprintf(stderr,
            "ddp-train: --data %s: a text or token corpus trains a causal language model (a "
            "GPT-2 config.json as --model, or --model_name_or_path DIR); the model %s takes "
            "a safetensors file of 'features' and 'labels', a CSV or an MNIST directory\n",
            src, t->model_path ? t->model_path : "(default: an MLP)");
    return 2;
  } else {
    st = ddp_dataset_from_safetensors(src, NULL, NULL, &t->all, &err);
  }
  if (st != DDP_OK) {
    fprintf(stderr, "ddp-train: --data %s: %s\n", src, train_why(st, &err));
    return 2;
  }
  t->data = src;
  if (strcmp(t->args.eval_strategy, "no") != 0 && t->args.eval_split > 0) {
    st = ddp_dataset_split(t->all, t->args.eval_split, t->args.seed, &t->train, &t->eval, &err);
    if (st != DDP_OK) {
      fprintf(stderr, "ddp-train: eval split: %s\n", train_why(st, &err));
      return 2;
    }
  }
  return 0;
}

static void fmt_time(char *buf, size_t cap, double s) {
  if (!isfinite(s) || s < 0) s = 0;
  long x = lround(s);
  if (x >= 3600) {
    snprintf(buf, cap, "%ld:%02ld:%02ld", x / 3600, x / 60 % 60, x % 60);
  } else {
    snprintf(buf, cap, "%ld:%02ld", x / 60, x % 60);
  }
}

/* Rank 0's progress: a bar redrawn in place on a terminal, log lines otherwise. */
static void on_event(void *user, const ddp_train_event_t *e) {
  tool_t *t = user;
  bool bar = t->tty && !t->args.disable_tqdm;
  char eta[32];
  fmt_time(eta, sizeof eta, e->eta_s);
  switch (e->kind) {
    case DDP_TRAIN_EV_STEP:
      if (bar && (e->step == e->max_steps || ddp_now_ns() - t->last_draw_ns >= 100000000)) {
        t->last_draw_ns = ddp_now_ns();
        int width = 24, fill = (int)(width * e->step / (e->max_steps ? e->max_steps : 1));
        char b[32];
        for (int i = 0; i < width; i++) b[i] = i < fill ? '#' : '-';
        b[width] = 0;
        printf("\r\033[K[%s] %" PRId64 "/%" PRId64 " loss %.4f lr %.2e %.0f samples/s ETA %s", b,
               e->step, e->max_steps, e->loss, e->lr, e->samples_per_s, eta);
        fflush(stdout);
      }
      return;
    case DDP_TRAIN_EV_LOG:
      printf("%sstep %6" PRId64 "/%" PRId64 "  epoch %6.2f  loss %.4f  grad_norm %.4f  lr %.3e  "
             "%.0f samples/s  step %.2f ms (comm %.2f ms)  ETA %s\n",
             bar ? "\r\033[K" : "", e->step, e->max_steps, e->epoch, e->loss, e->grad_norm, e->lr,
             e->samples_per_s, e->step_time_s * 1e3, e->comm_time_s * 1e3, eta);
      break;
    case DDP_TRAIN_EV_EVAL:
      if (t->text.task == DDP_TASK_CAUSAL_LM) { /* run_clm's perplexity */
        printf("%seval  step %6" PRId64 "  eval_loss %.4f  perplexity %.2f\n",
               bar ? "\r\033[K" : "", e->step, e->eval_loss, exp(e->eval_loss));
      } else if (isnan(e->eval_accuracy)) {
        printf("%seval  step %6" PRId64 "  eval_loss %.4f\n", bar ? "\r\033[K" : "", e->step,
               e->eval_loss);
      } else {
        printf("%seval  step %6" PRId64 "  eval_loss %.4f  eval_accuracy %.2f%%\n",
               bar ? "\r\033[K" : "", e->step, e->eval_loss, 100 * e->eval_accuracy);
      }
      break;
    case DDP_TRAIN_EV_SAVE: printf("%ssaved  %s\n", bar ? "\r\033[K" : "", e->checkpoint); break;
  }
  fflush(stdout);
}

static ddp_status_t run_rank(ddp_pg_t *pg, void *arg) {
  tool_t *t = arg;
  int rank = ddp_pg_rank(pg);
  ddp_error_t err = {0};
  ddp_model_t *model = NULL;
  ddp_train_result_t res;
  ddp_status_t st = train_text_build(&t->text, t->model_json, t->args.seed, &model, &err);
  if (st == DDP_OK && t->init) st = ddp_model_load(model, t->init, true, NULL, NULL, &err);
  if (st == DDP_OK) {
    st = ddp_train(pg, model, t->train ? t->train : t->all, t->eval, &t->args, on_event, t, &res,
                   &err);
  }
  if (st == DDP_OK && rank == 0) st = train_text_finish(&t->text, model, &t->args, &err);
  int none = -1;
  if (st != DDP_OK && atomic_compare_exchange_strong(&t->failed_rank, &none, rank)) {
    t->failed_status = st; /* read after the ranks are joined */
    snprintf(t->failed_msg, sizeof t->failed_msg, "%s", train_why(st, &err));
  }
  if (rank == 0) {
    t->status = st;
    snprintf(t->errmsg, sizeof t->errmsg, "%s", train_why(st, &err));
    if (st == DDP_OK) t->result = res;
  } else if (st != DDP_OK && !t->threads) {
    fprintf(stderr, "ddp-train: rank %d: %s: %s\n", rank, ddp_status_name(st), train_why(st, &err));
  }
  ddp_model_destroy(model);
  return st;
}

static void summary(const tool_t *t) {
  const ddp_train_result_t *r = &t->result;
  if (t->tty && !t->args.disable_tqdm) printf("\r\033[K");
  printf("ddp-train: %" PRId64 " steps (from step %" PRId64 ") x %d ranks (%s) x batch %" PRId64
         " x accumulation %" PRId64 " in %.2f s: %.0f samples/s, %.3f s in gradient sync\n",
         r->steps, r->start_step, t->world, t->backend, t->args.per_device_train_batch_size,
         t->args.gradient_accumulation_steps, r->seconds, r->samples_per_s, r->comm_seconds);
  printf("ddp-train: loss %.4f -> %.4f", r->first_loss, r->last_loss);
  if (!isnan(r->eval_loss)) printf(", eval_loss %.4f", r->eval_loss);
  if (!isnan(r->eval_accuracy)) printf(", eval_accuracy %.2f%%", 100 * r->eval_accuracy);
  printf("\n");
  printf("ddp-train: replica check passed %d times; every rank holds parameters %016" PRIx64 "\n",
         r->replica_checks, r->param_hash);
  printf("ddp-train: wrote %s/metrics.jsonl and %s/loss.svg%s%s\n", t->args.output_dir,
         t->args.output_dir, r->last_checkpoint[0] ? "; last checkpoint " : "", r->last_checkpoint);
}

int main(int argc, char **argv) {
  static tool_t t;
  t.args = (ddp_train_args_t)DDP_TRAIN_ARGS_INIT;
  t.text = (train_text_t)TRAIN_TEXT_INIT;
  t.args.ddp_timeout = 0; /* 0 after parsing: not given; then DDP_TIMEOUT, else the default */
  atomic_init(&t.failed_rank, -1);
  int rc = parse_args(&t, argc, argv);
  if (rc) return rc;
  if (t.args.ddp_timeout == 0) {
    int64_t s = 1800;
    ddp_error_t terr = {0};
    if (ddp_env_is_set(DDP_ENV_TIMEOUT) && ddp_env_int(DDP_ENV_TIMEOUT, 1, 1000000000, &s, &terr)) {
      fprintf(stderr, "ddp-train: %s\n", terr.msg);
      return 2;
    }
    t.args.ddp_timeout = s; /* ddprun --timeout S reaches the trainer through DDP_TIMEOUT */
  }
  ddp_error_t err = {0};
  ddp_fault_t fault;
  if (ddp_fault_from_env(&fault, &err) != DDP_OK) {
    fprintf(stderr, "ddp-train: %s\n", err.msg);
    return 2;
  }
  ddp_status_t st = ddp_train_args_validate(&t.args, &err);
  if (st != DDP_OK) {
    fprintf(stderr, "ddp-train: %s\n", train_why(st, &err));
    return 2;
  }
  if (t.print_args) {
    char *js = NULL;
    if (ddp_train_args_to_json(&t.args, &js) != DDP_OK) return 1;
    printf("%s\n", js);
    ddp_free(js);
    return 0;
  }
  /* Launched: torchrun-style RANK/WORLD_SIZE (ddprun), Open MPI's mpirun, or srun; the
   * same variables ddp_pg_create_from_env reads. */
  bool launched = (ddp_env_is_set(DDP_ENV_RANK) && ddp_env_is_set(DDP_ENV_WORLD_SIZE)) ||
                  (ddp_env_is_set(DDP_ENV_OMPI_RANK) && ddp_env_is_set(DDP_ENV_OMPI_SIZE)) ||
                  (ddp_env_is_set(DDP_ENV_SLURM_PROCID) && ddp_env_is_set(DDP_ENV_SLURM_NTASKS));
  const char *backend = ddp_train_backend_name(&t.args);
  if (launched && t.threads) {
    fprintf(stderr, "ddp-train: --threads runs ranks in one process; under a launcher "
                    "(RANK/WORLD_SIZE, OMPI_COMM_WORLD_* or SLURM_* are set) leave it out\n");
    return 2;
  }
  if (launched && backend && !strcmp(backend, "threads")) {
    fprintf(stderr, "ddp-train: ddp_backend threads needs --threads, not a launcher\n");
    return 2;
  }
  if (!launched && backend && strcmp(backend, "threads") != 0) {
    fprintf(stderr,
            "ddp-train: ddp_backend %s needs one process per rank: run under ddprun "
            "(ddprun --nproc_per_node N --backend %s ddp-train ...), or use --threads\n",
            backend, backend);
    return 2;
  }
  const char *resume = t.args.resume_from_checkpoint;
  if (resume[0] && strcasecmp(resume, "false") != 0) {
    char dir[DDP_TRAIN_STR_MAX];
    if (!strcasecmp(resume, "true") || !strcasecmp(resume, "latest")) {
      if ((st = ddp_train_latest_checkpoint(t.args.output_dir, dir, sizeof dir, &err)) != DDP_OK) {
        fprintf(stderr, "ddp-train: --resume_from_checkpoint %s: %s\n", resume,
                train_why(st, &err));
        return 2;
      }
    } else if (!is_dir(resume)) {
      fprintf(stderr, "ddp-train: --resume_from_checkpoint %s: no such checkpoint directory\n",
              resume);
      return 2;
    }
  }
  if ((rc = train_text_probe(&t.text, t.model_path)) != 0) return rc;
  if ((rc = train_text_check_flags(&t.text, t.model_path)) != 0) return rc;
  /* The model file before the data: its own error (a JSON syntax error with its line and
   * column, a missing "layers" or "model_type") is not to be blamed on the data. */
  if (t.model_path) {
    t.model_json = train_read_file(t.model_path);
    if (!t.model_json) {
      fprintf(stderr, "ddp-train: --model %s: %s\n", t.model_path, strerror(errno));
      return 2;
    }
    ddp_model_t *m = NULL;
    if (!t.text.hf && (st = ddp_model_from_json(t.model_json, &m, &err)) != DDP_OK) {
      fprintf(stderr, "ddp-train: --model %s: %s\n", t.model_path, train_why(st, &err));
      return 2;
    }
    ddp_model_destroy(m);
  }
  if ((rc = load_data(&t)) != 0) return rc;
  if (!t.model_path && !t.text.name_or_path && (rc = build_default_model(&t)) != 0) return rc;
  const char *model_desc = t.model_path          ? t.model_path
                           : t.text.name_or_path ? t.text.name_or_path
                                                 : "(default)";
  ddp_model_t *probe = NULL;
  if ((st = train_text_build(&t.text, t.model_json, t.args.seed, &probe, &err)) != DDP_OK) {
    fprintf(stderr, "ddp-train: --model %s: %s\n", model_desc, train_why(st, &err));
    return 2;
  }
  if (t.init && (st = ddp_model_load(probe, t.init, true, NULL, NULL, &err)) != DDP_OK) {
    fprintf(stderr, "ddp-train: --init %s: %s\n", t.init, train_why(st, &err));
    ddp_model_destroy(probe);
    return 2;
  }
  /* A given model's class labels against its outputs, before any rank starts. */
  const ddp_sample_spec_t *dsp = ddp_dataset_spec(t.all);
  if (t.model_path && !t.text.hf && dsp->label_dtype == DDP_I64 && dsp->label_ndim == 0) {
    int64_t classes = -1, maxl;
    rc = train_model_outputs(model_desc, t.data, probe, t.all, &classes);
    if (!rc && classes > 0) rc = train_check_labels(t.data, t.all, classes, &maxl);
    if (rc) {
      ddp_model_destroy(probe);
      return rc;
    }
  }
  ddp_model_destroy(probe);
  const char *q_path = t.args.power_sgd_init_q;
  if (q_path[0]) {
    ddp_st_file_t *qf = NULL;
    if ((st = ddp_st_open(q_path, DDP_ST_READ, &qf, &err)) != DDP_OK ||
        !ddp_st_meta_get(qf, "draws")) {
      fprintf(stderr, "ddp-train: --power_sgd_init_q %s: %s\n", q_path,
              st != DDP_OK ? train_why(st, &err)
                           : "no \"draws\" in the metadata; expected the "
                             "powersgd_q.safetensors that tools/torch/torch_reference.py writes");
      ddp_st_close(qf);
      return 2;
    }
    ddp_st_close(qf);
  }
  t.tty = isatty(STDOUT_FILENO);

  ddp_pg_options_t po = DDP_PG_OPTIONS_INIT;
  po.timeout_ms = t.args.ddp_timeout * 1000;
  bool root = true;
  if (launched) {
    ddp_pg_t *pg = NULL;
    po.backend = backend;
    if ((st = ddp_pg_create_from_env(&po, &pg, &err)) != DDP_OK) {
      fprintf(stderr, "ddp-train: process group: %s: %s\n", ddp_status_name(st),
              train_why(st, &err));
      return 1;
    }
    t.world = ddp_pg_size(pg);
    t.backend = ddp_pg_backend_name(pg);
    root = ddp_pg_rank(pg) == 0;
    if (root) {
      printf("ddp-train: %d ranks as processes, backend %s, data %s (%" PRId64 " samples)\n",
             t.world, t.backend, t.data, ddp_dataset_length(t.all));
      fflush(stdout);
    }
    st = run_rank(pg, &t);
    ddp_pg_destroy(pg);
  } else {
    t.world = t.threads ? t.threads : 1;
    t.backend = "threads";
    printf("ddp-train: %d ranks as threads, data %s (%" PRId64 " samples)\n", t.world, t.data,
           ddp_dataset_length(t.all));
    fflush(stdout);
    st = ddp_spawn_threads(t.world, &po, run_rank, &t);
  }
  if (root) {
    if (st != DDP_OK || t.status != DDP_OK) {
      /* Rank 0's reason; with thread ranks, also the first failing rank's when another. */
      int first = atomic_load(&t.failed_rank);
      if (t.tty) printf("\n");
      if (t.status != DDP_OK) {
        fprintf(stderr, "ddp-train: training failed: %s: %s\n", ddp_status_name(t.status),
                t.errmsg);
      }
      if (first > 0 || t.status == DDP_OK) {
        fprintf(stderr, "ddp-train: training failed: rank %d: %s: %s\n", first < 0 ? 0 : first,
                ddp_status_name(first < 0 ? st : t.failed_status),
                first < 0 ? ddp_status_str(st) : t.failed_msg);
      }
    } else {
      summary(&t);
      train_text_summary(&t.text, &t.args, &t.result);
    }
  }
  ddp_dataset_destroy(t.train);
  ddp_dataset_destroy(t.eval);
  ddp_dataset_destroy(t.all);
  free(t.model_json);
  train_text_free(&t.text);
  return st == DDP_OK ? 0 : 1;
}
