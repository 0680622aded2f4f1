/* PyTorch parity driver shared by tests/test_ddp_parity.c and tests/test_hooks_parity.c.
 *
 * ddp_test_parity() runs one configuration end to end, each side as its real tool:
 * tools/torch/torch_reference.py (real PyTorch 1.13 DDP over gloo, /usr/bin/python3) writes dump
 * A; $DDP_BUILD_ROOT/tools/ddp-train --threads W then runs the same job from the weights A
 * recorded after DDP's initial broadcast, with the same samples (DistributedSampler, same
 * seed), micro-batching, loss scaling, SGD, DDP options, forward flags and comm hook, and
 * writes dump B (--dump_dir); finally $DDP_BUILD_ROOT/tools/ddp-compare --json A B must
 * exit 0 and both sides' bucket layouts, parameter names and bucket sizes must be
 * identical on every rank.
 *
 * Files of configuration c, under the scratch directory: <name>/model.json, <name>/torch
 * (dump A), <name>/libddp (dump B); ddp-train's output_dir is the dump directory + ".out".
 *
 * The parent asserts (CMocka); the tools are child processes. */
#ifndef DDP_TEST_PARITY_H
#define DDP_TEST_PARITY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* torch_reference.py and ddp-train --seed: the sampler's seed (and initial weights, which
 * torch_dir's weights.safetensors replaces). */
#define DDP_TEST_PARITY_SEED 1234

/* An MLP (64 -> 32, ReLU) with a logits head and an auxiliary head summed by an "add" node
 * with named modules; the aux branch runs only when flag bit 0 is set (issue 14: its
 * gradient is None wherever no rank runs it). Parameters: fc1.weight, fc1.bias,
 * heads.logits.0.weight, heads.logits.0.bias, heads.aux.0.weight, heads.aux.0.bias. */
#define DDP_TEST_AUX_MODEL                                                                 \
  "{\"dtype\": \"f32\", \"layers\": [{\"type\": \"linear\", \"in\": 64, \"out\": 32, "     \
  "\"name\": \"fc1\"}, {\"type\": \"relu\"}, {\"type\": \"add\", \"name\": \"heads\", "    \
  "\"branches\": [{\"name\": \"logits\", \"layers\": [{\"type\": \"linear\", \"in\": 32, " \
  "\"out\": 10}]}, {\"name\": \"aux\", \"flag\": 0, \"layers\": [{\"type\": \"linear\", "  \
  "\"in\": 32, \"out\": 10}]}]}]}"

typedef struct ddp_test_pcfg {
  const char *name;  /* a directory name under the scratch directory */
  const char *model; /* model JSON (docs/nn.md) */
  int world, steps, batch, accum;
  double lr, momentum;  /* SGD; ddp-train gets --optim_args momentum=M */
  const char *flags;    /* per rank, cycled: torch_reference.py --flags, ddp-train
                         * --forward_flags; NULL = "0" */
  double bucket_cap_mb; /* < 0: not given; else MiB (fractions allowed), with PyTorch
                         * 1.13's 1 MiB first bucket on the libddp side
                         * (--ddp_first_bucket_mb 1) */
  bool find_unused, broadcast_buffers, static_graph, grad_as_bucket_view;
  bool rebuilt; /* a rebuilt layout is expected */
  /* Optional: arguments both tools take alike (--comm_hook, --comm_wrapper,
   * --comm_state_option), and ddp-compare tolerances (0: its defaults, rtol 1e-5 /
   * atol 1e-7). */
  const char *hook_args;
  bool inject_q; /* ddp-train --power_sgd_init_q <dump A>/powersgd_q.safetensors */
  double rtol, atol;
  /* Optional, for Transformers models (model: a config.json): the dataset both tools read
   * (NULL: the digits), arguments both take alike (--block_size 32, --max_seq_length 16),
   * and the first bucket's cap in MiB on both sides (> 0: torch_reference.py
   * --first_bucket_mb, ddp-train --ddp_first_bucket_mb; else 1 MiB with an explicit cap,
   * PyTorch 1.13's default). */
  const char *data;
  const char *data_args;
  double first_bucket_mb;
  /* Optional: arguments for one side only, after the shared ones (torch_reference.py
   * --zero; ddp-train --deepspeed ds.json). */
  const char *torch_args;
  const char *train_args;
} ddp_test_pcfg_t;

/* The largest differences ddp-compare reported, over every step, rank and element. */
typedef struct ddp_test_parity_result {
  double grad_abs, grad_rel, param_abs, param_rel, buffer_abs, buffer_rel;
  int64_t grad_elements, grad_bitwise;  /* gradient elements compared, and those bit-equal */
  int buckets_initial, buckets_rebuilt; /* rank 0's layouts (rebuilt: -1 when none) */
} ddp_test_parity_result_t;

/* Sets the scratch directory (created by the caller, kept for the run; where
 * ddp_test_run_cmd leaves stderr) and finds ddp-compare, ddp-train, the digits dataset and
 * /usr/bin/python3 with torch. Returns false when the source root is unknown (the scratch
 * directory and the tools are set all the same). */
bool ddp_test_parity_init(const char *scratch_dir);
/* A parity test file's main: runs tests (n of them) as one CMocka group between making the
 * scratch directory /tmp/<name>_XXXXXX with ddp_test_parity_init and removing it (kept when
 * DDP_PARITY_KEEP is set); returns what cmocka_run_group_tests returns. DDP_TEST_FILTER, when
 * set, is cmocka's test filter (a name or a glob: DDP_TEST_FILTER='test_llama*'), to run
 * some of a long file's tests by hand. */
struct CMUnitTest;
int ddp_test_parity_main(const char *name, const struct CMUnitTest *tests, size_t n);
/* The scratch directory given to ddp_test_parity_init. */
const char *ddp_test_parity_scratch(void);
/* Whether torch, ddp-compare and ddp-train are all available (else the parity tests
 * skip). */
bool ddp_test_parity_available(void);
/* The ddp-compare executable and the digits dataset, as found by ddp_test_parity_init. */
const char *ddp_test_parity_compare_tool(void);
const char *ddp_test_parity_dataset(void);

/* One configuration end to end (see the header comment); skips the test when
 * !ddp_test_parity_available(). out may be NULL. */
void ddp_test_parity(const ddp_test_pcfg_t *c, ddp_test_parity_result_t *out);

/* The libddp side alone: ddp-train for c, on <name>/model.json (the caller writes it;
 * ddp_test_parity does), from torch_dir/weights.safetensors (torch_dir NULL: ddp-train's
 * own seeded initialisation, the same on every rank), with PyTorch's Q from torch_dir when
 * c->inject_q, writing a dump to dump_dir; extra (may be NULL) is appended to the command
 * line, where it overrides what came before. Returns ddp-train's exit status (its stderr
 * is in scratch/stderr.txt). */
int ddp_test_parity_train(const ddp_test_pcfg_t *c, const char *torch_dir, const char *dump_dir,
                          const char *extra);

/* Small helpers the parity tests share. write_text/read_json fail the test on error;
 * read_text returns NULL when the file cannot be read (malloc'd otherwise). */
void ddp_test_write_text(const char *path, const char *text);
char *ddp_test_read_text(const char *path);
struct cJSON *ddp_test_read_json(const char *path);
const struct cJSON *ddp_test_json_get(const struct cJSON *o, const char *key);
/* Runs a shell command (ddp_test_proc_run, proc.h): stdout into *out (malloc'd; NULL =
 * discard), stderr into scratch/stderr.txt, killed after DDP_TEST_CMD_TIMEOUT_S seconds
 * (under the 120 s limit of the shortest test that runs commands). Returns the exit
 * status, -1 when it did not exit normally. */
#define DDP_TEST_CMD_TIMEOUT_S 110.0
int ddp_test_run_cmd(char **out, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* scratch/stderr.txt (the last command's stderr), malloc'd; NULL when unreadable. */
char *ddp_test_cmd_stderr(void);
/* Prints scratch/stderr.txt (the last command's stderr) as a CMocka error message. */
void ddp_test_print_cmd_stderr(void);

/* A test file's scratch directory: makes /tmp/<name>_XXXXXX into dir (cap bytes) with
 * mkdtemp, false on failure; removes it again (nothing when dir is empty, or when keep_env
 * and DDP_PARITY_KEEP is set), 0 on success and 1 on failure, as a CMocka group teardown
 * returns. */
bool ddp_test_make_scratch(char *dir, size_t cap, const char *name);
int ddp_test_remove_scratch(const char *dir, bool keep_env);

#endif /* DDP_TEST_PARITY_H */
