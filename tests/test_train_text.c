/* ddp-train on Transformers models and text (issue 13, items 7 and 8; docs/train.md,
 * "Language models and BERT"):
 *  - determinism: GPT-2 tiny (dropout on) with --threads 4, ddprun shm x4 and ddprun tcp x4
 *    ends with the same parameter hash; the store port comes from the kernel, never from a
 *    formula or a constant;
 *  - checkpoints: a checkpoint directory and the final model written by ddp-train load in
 *    the PyTorch oracle module (tools/torch/hf_models.py) by name with strict=True; a directory
 *    the oracle wrote with save_pretrained loads in ddp-train (--model_name_or_path) with
 *    every tensor bitwise; resuming from a checkpoint ends bitwise where the uninterrupted
 *    run ended;
 *  - evaluation: metrics.jsonl carries eval_loss and perplexity = exp(eval_loss);
 *  - the loss falls on the text and rank 0 prints a sample; ddp_generate is greedy or
 *    seeded top-k, crops the context to n_positions and refuses what it cannot do;
 *  - bad input: exit 2 for usage, 1 for data, with a message naming the file or key.
 * Tests that need torch skip without it. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "ddp.h"
#include "harness.h"
#include "parity.h"
#include "proc.h"

/* GPT-2 tiny with Transformers' default dropout (0.1): determinism and resume must replay
 * the dropout draws too. */
static const char *const GPT2 =
    "{\"model_type\": \"gpt2\", \"n_layer\": 2, \"n_embd\": 64, \"n_head\": 4, "
    "\"vocab_size\": 256, \"n_positions\": 64}";

/* The tiny Llama (GQA: 4 heads, 2 KV heads; untied head). */
static const char *const LLAMA =
    "{\"model_type\": \"llama\", \"hidden_size\": 64, \"num_hidden_layers\": 2, "
    "\"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"vocab_size\": 256, "
    "\"intermediate_size\": 172, \"max_position_embeddings\": 64}";

static char g_dir[512], g_cfg[600], g_corpus[600], g_train[600], g_ddprun[600], g_llama[600];
static const char *g_model = g_cfg; /* the --model of train() */

/* The scratch directory's files, written once: the config and a 12 KB text. */
static void setup_files(void) {
  if (g_cfg[0]) return;
  const char *build = getenv("DDP_BUILD_ROOT");
  snprintf(g_train, sizeof g_train, "%s/tools/ddp-train", build ? build : ".");
  snprintf(g_ddprun, sizeof g_ddprun, "%s/tools/ddprun", build ? build : ".");
  snprintf(g_dir, sizeof g_dir, "%s", ddp_test_parity_scratch());
  snprintf(g_cfg, sizeof g_cfg, "%s/gpt2.json", g_dir);
  snprintf(g_corpus, sizeof g_corpus, "%s/corpus.txt", g_dir);
  ddp_test_write_text(g_cfg, GPT2);
  snprintf(g_llama, sizeof g_llama, "%s/llama.json", g_dir);
  ddp_test_write_text(g_llama, LLAMA);
  static const char *const w[] = {"the", "cat", "sat", "on", "a",    "mat",  "and",   "the",
                                  "dog", "ran", "to",  "it", "then", "both", "slept", "well"};
  static char text[13000];
  size_t len = 0;
  uint32_t s = 11;
  while (len < sizeof text - 16) {
    s = s * 1664525u + 1013904223u;
    len += (size_t)snprintf(text + len, sizeof text - len, "%s ", w[(s >> 16) % 16]);
  }
  ddp_test_write_text(g_corpus, text);
}

/* ddp-train with the common GPT-2 flags plus extra; stdout into *out (may be NULL). */
static int train(char **out, const char *launcher, const char *outdir, const char *extra) {
  setup_files();
  return ddp_test_run_cmd(out,
                          "OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 %s '%s' --model '%s' --data "
                          "'%s' --block_size 32 --per_device_train_batch_size 4 "
                          "--learning_rate 3e-3 --logging_steps 2 --disable_tqdm --output_dir "
                          "'%s/%s' %s",
                          launcher ? launcher : "", g_train, g_model, g_corpus, g_dir, outdir,
                          extra ? extra : "");
}

static void train_ok(char **out, const char *launcher, const char *outdir, const char *extra) {
  int rc = train(out, launcher, outdir, extra);
  if (rc != 0) {
    ddp_test_print_cmd_stderr();
    fail_msg("ddp-train into %s exited %d", outdir, rc);
  }
}

/* The summary line of outdir/metrics.jsonl (caller deletes). */
static cJSON *summary(const char *outdir) {
  char path[800], line[16384];
  snprintf(path, sizeof path, "%s/%s/metrics.jsonl", g_dir, outdir);
  FILE *f = fopen(path, "r");
  if (!f) fail_msg("no %s", path);
  cJSON *found = NULL;
  while (fgets(line, sizeof line, f)) {
    cJSON *o = cJSON_Parse(line);
    if (o && cJSON_GetObjectItem(o, "summary")) {
      cJSON_Delete(found);
      found = o;
    } else {
      cJSON_Delete(o);
    }
  }
  fclose(f);
  if (!found) fail_msg("%s has no summary line", path);
  return found;
}

static void summary_hash(const char *outdir, char *h, size_t cap) {
  cJSON *s = summary(outdir);
  snprintf(h, cap, "%s", ddp_test_json_get(s, "param_hash")->valuestring);
  cJSON_Delete(s);
}

/* ---------------------------------------------------------------- determinism ----- */

/* ddprun --standalone: the store's port reserved from the kernel before any rank starts. */
static void ddprun_train(const char *backend, int n, const char *outdir, const char *extra) {
  char launcher[900];
  snprintf(launcher, sizeof launcher, "'%s' --nproc_per_node %d --backend %s --standalone",
           g_ddprun, n, backend);
  setup_files();
  int rc = train(NULL, launcher, outdir, extra);
  if (rc != 0) {
    ddp_test_print_cmd_stderr();
    fail_msg("ddprun %s x%d exited %d", backend, n, rc);
  }
}

static void test_determinism(void **state) {
  (void)state;
  const char *common = "--max_steps 6 --save_strategy no --ddp_find_unused_parameters false";
  char ht[64], hs[64], hc[64];
  train_ok(NULL, NULL, "det_threads",
           "--threads 4 --max_steps 6 --save_strategy no "
           "--ddp_find_unused_parameters false");
  ddprun_train("shm", 4, "det_shm", common);
  ddprun_train("tcp", 4, "det_tcp", common);
  summary_hash("det_threads", ht, sizeof ht);
  summary_hash("det_shm", hs, sizeof hs);
  summary_hash("det_tcp", hc, sizeof hc);
  print_message("GPT-2 tiny, 6 steps: threads x4 %s, ddprun shm x4 %s, ddprun tcp x4 %s\n", ht, hs,
                hc);
  assert_string_equal(ht, hs);
  assert_string_equal(ht, hc);
}

/* Llama through ddp-train: threads x4, ddprun shm x4 and tcp x4 end with one parameter
 * hash, the loss falls, and the saved directory loads strictly in the PyTorch twin. */
static void test_llama(void **state) {
  (void)state;
  const char *common = "--max_steps 6 --save_strategy no --ddp_find_unused_parameters false";
  char ht[64], hs[64], hc[64];
  g_model = g_llama;
  train_ok(NULL, NULL, "llama_threads",
           "--threads 4 --max_steps 6 --save_strategy no --ddp_find_unused_parameters false");
  ddprun_train("shm", 4, "llama_shm", common);
  ddprun_train("tcp", 4, "llama_tcp", common);
  g_model = g_cfg;
  summary_hash("llama_threads", ht, sizeof ht);
  summary_hash("llama_shm", hs, sizeof hs);
  summary_hash("llama_tcp", hc, sizeof hc);
  print_message("Llama tiny, 6 steps: threads x4 %s, ddprun shm x4 %s, ddprun tcp x4 %s\n", ht, hs,
                hc);
  assert_string_equal(ht, hs);
  assert_string_equal(ht, hc);
  cJSON *s = summary("llama_threads");
  double first = ddp_test_json_get(s, "first_loss")->valuedouble;
  double last = ddp_test_json_get(s, "last_loss")->valuedouble;
  cJSON_Delete(s);
  if (!(last < first)) fail_msg("Llama loss did not fall: %g -> %g", first, last);
}

/* Llama under --world_size_invariant_shards 8 (8 samples per step in 8 shards): threads x1,
 * x2 and x4 end with one hash; the normal DDP run at x4 ends with another (its sums differ by
 * world size, which is what the mode removes). */
static void test_llama_invariant(void **state) {
  (void)state;
  char h1[64], h2[64], h4[64], hd[64];
  const char *common = "--max_steps 4 --save_strategy no --world_size_invariant_shards 8";
  char extra[256];
  g_model = g_llama;
  for (int w = 1; w <= 4; w *= 2) {
    char dir[32];
    snprintf(dir, sizeof dir, "llama_inv_%d", w);
    snprintf(extra, sizeof extra, "--threads %d %s --per_device_train_batch_size %d", w, common,
             8 / w);
    train_ok(NULL, NULL, dir, extra);
  }
  train_ok(NULL, NULL, "llama_inv_ddp4",
           "--threads 4 --max_steps 4 --save_strategy no --per_device_train_batch_size 2");
  g_model = g_cfg;
  summary_hash("llama_inv_1", h1, sizeof h1);
  summary_hash("llama_inv_2", h2, sizeof h2);
  summary_hash("llama_inv_4", h4, sizeof h4);
  summary_hash("llama_inv_ddp4", hd, sizeof hd);
  print_message("Llama invariant: x1 %s, x2 %s, x4 %s; normal DDP x4 %s\n", h1, h2, h4, hd);
  assert_string_equal(h1, h2);
  assert_string_equal(h1, h4);
  assert_string_not_equal(h4, hd);
}

/* llm.c's Llama 3 token files (magic 20240801, version 7, uint32 ids) train a Llama as the
 * same ids from text do: the corpus written by ddp_tokens_write_llmc_llama3 ends with the
 * parameter hash of the corpus read as bytes. Ids beyond the vocabulary are refused naming
 * the file, the id, its position, the limit and the model; a Llama 3 file given to GPT-2 says
 * which format GPT-2 reads. */
static void test_llama_llmc_tokens(void **state) {
  (void)state;
  setup_files();
  char bin[600], big[600], h_txt[64], h_bin[64], saved[600];
  size_t len = 0;
  char *text = NULL;
  FILE *f = fopen(g_corpus, "rb");
  assert_non_null(f);
  text = malloc(16384);
  len = fread(text, 1, 16384, f);
  fclose(f);
  int64_t *ids = malloc(len * sizeof *ids);
  for (size_t i = 0; i < len; i++) ids[i] = (unsigned char)text[i];
  free(text);
  ddp_error_t err = {0};
  snprintf(bin, sizeof bin, "%s/corpus_llama3.bin", g_dir);
  assert_int_equal(ddp_tokens_write_llmc_llama3(bin, ids, (int64_t)len, &err), DDP_OK);
  ids[1] = 128000; /* Llama 3's <|begin_of_text|>, beyond a byte vocabulary */
  snprintf(big, sizeof big, "%s/llama3_vocab.bin", g_dir);
  assert_int_equal(ddp_tokens_write_llmc_llama3(big, ids, (int64_t)len, &err), DDP_OK);
  free(ids);

  const char *common = "--max_steps 2 --save_strategy no --ddp_find_unused_parameters false";
  g_model = g_llama;
  train_ok(NULL, NULL, "llama_txt", common);
  snprintf(saved, sizeof saved, "%s", g_corpus);
  snprintf(g_corpus, sizeof g_corpus, "%s", bin);
  train_ok(NULL, NULL, "llama_bin", common);
  summary_hash("llama_txt", h_txt, sizeof h_txt);
  summary_hash("llama_bin", h_bin, sizeof h_bin);
  print_message("Llama tiny, 2 steps: text %s, llm.c Llama 3 file %s\n", h_txt, h_bin);
  assert_string_equal(h_txt, h_bin);

  /* An id beyond vocab_size 256, for the Llama and for GPT-2. */
  snprintf(g_corpus, sizeof g_corpus, "%s", big);
  for (int k = 0; k < 2; k++) {
    g_model = k == 0 ? g_llama : g_cfg;
    int rc = train(NULL, NULL, "llama_vocab", common);
    char *e = ddp_test_cmd_stderr();
    char want[1200];
    snprintf(want, sizeof want,
             "--data %s: lm blocks: token id 128000 at position 1 is outside the vocabulary "
             "[0, vocab_size 256) of the model %s (%s)",
             big, g_model, k == 0 ? "llama" : "gpt2");
    bool hint = e && strstr(e, "the file is llm.c's Llama 3 format (magic 20240801, version 7");
    if (rc != 1 || !e || !strstr(e, want) || hint != (k == 1))
      fail_msg("%s on ids beyond the vocabulary: exit %d (want 1), stderr lacks \"%s\"%s: %s",
               k == 0 ? "Llama" : "GPT-2", rc, want,
               k == 1 ? " and the format hint" : " or has GPT-2's hint", e ? e : "");
    const char *line = strstr(e, "ddp-train: --data");
    print_message("%s: %.*s\n", k == 0 ? "Llama" : "GPT-2", (int)strcspn(line, "\n"), line);
    free(e);
  }
  g_model = g_cfg;
  snprintf(g_corpus, sizeof g_corpus, "%s", saved);
}

/* ---------------------------------------------------------------- checkpoints ----- */

/* Runs tools/torch/hf_models.py check on dir: the oracle loads it by name, strict. */
static void oracle_loads(const char *dir) {
  char *out = NULL;
  int rc = ddp_test_run_cmd(&out, "OMP_NUM_THREADS=1 %s %s/tools/torch/hf_models.py check '%s'",
                            ddp_test_python(), ddp_test_source_root(), dir);
  if (rc != 0 || !out || strncmp(out, "ok", 2) != 0) {
    ddp_test_print_cmd_stderr();
    fail_msg("the oracle did not load %s (exit %d): %s", dir, rc, out ? out : "");
  }
  print_message("oracle loads %s strictly: %.60s...\n", dir, out);
  free(out);
}

static void need_torch(void) {
  if (!ddp_test_python()) {
    print_message("torch (under /usr/bin/python3) absent: skipped\n");
    skip();
  }
}

static void test_checkpoint_to_oracle(void **state) {
  (void)state;
  need_torch();
  train_ok(NULL, NULL, "ckpt", "--threads 2 --max_steps 4 --save_steps 2");
  char dir[800];
  snprintf(dir, sizeof dir, "%s/ckpt/checkpoint-4", g_dir);
  oracle_loads(dir);
  /* Transformers' layout: config.json, model.safetensors without the tied lm_head, plus the
   * trainer's files. */
  char p[900];
  static const char *const files[] = {"config.json", "model.safetensors", "optimizer.safetensors",
                                      "trainer_state.json"};
  for (size_t i = 0; i < 4; i++) {
    snprintf(p, sizeof p, "%s/%s", dir, files[i]);
    if (access(p, R_OK) != 0) fail_msg("checkpoint lacks %s", p);
  }
  snprintf(p, sizeof p, "%s/model.safetensors", dir);
  ddp_st_file_t *f = NULL;
  ddp_error_t err = {0};
  if (ddp_st_open(p, DDP_ST_READ, &f, &err) != DDP_OK) fail_msg("%s: %s", p, err.msg);
  size_t idx;
  assert_int_equal(ddp_st_find(f, "lm_head.weight", &idx), DDP_ERR_NOT_FOUND);
  assert_int_equal(ddp_st_find(f, "transformer.wte.weight", &idx), DDP_OK);
  assert_string_equal(ddp_st_meta_get(f, "format"), "pt");
  ddp_st_close(f);
  /* The final model, as Trainer.save_model writes it. */
  snprintf(dir, sizeof dir, "%s/ckpt", g_dir);
  oracle_loads(dir);
}

/* A directory the oracle wrote (Transformers' init from torch's RNG, save_pretrained)
 * loads in ddp-train: its init dump holds every tensor bitwise. */
static void test_oracle_to_libddp(void **state) {
  (void)state;
  need_torch();
  setup_files();
  char dir[800];
  snprintf(dir, sizeof dir, "%s/oracle_model", g_dir);
  assert_int_equal(mkdir(dir, 0755), 0);
  char cfg[900];
  snprintf(cfg, sizeof cfg, "%s/config.json", dir);
  ddp_test_write_text(cfg, GPT2);
  char *out = NULL;
  int rc = ddp_test_run_cmd(&out, "OMP_NUM_THREADS=1 %s %s/tools/torch/hf_models.py init '%s' 5",
                            ddp_test_python(), ddp_test_source_root(), dir);
  free(out);
  if (rc != 0) {
    ddp_test_print_cmd_stderr();
    fail_msg("hf_models.py init exited %d", rc);
  }
  char extra[1200];
  snprintf(extra, sizeof extra, "--max_steps 1 --save_strategy no --dump_dir '%s/from_oracle_dump'",
           g_dir);
  /* --model_name_or_path instead of --model: run the command by hand. */
  rc = ddp_test_run_cmd(NULL,
                        "OMP_NUM_THREADS=1 '%s' --model_name_or_path '%s' --data '%s' "
                        "--block_size 32 --per_device_train_batch_size 4 --disable_tqdm "
                        "--output_dir '%s/from_oracle' %s",
                        g_train, dir, g_corpus, g_dir, extra);
  if (rc != 0) {
    ddp_test_print_cmd_stderr();
    fail_msg("ddp-train --model_name_or_path %s exited %d", dir, rc);
  }
  char a[900], b[900];
  snprintf(a, sizeof a, "%s/model.safetensors", dir);
  snprintf(b, sizeof b, "%s/from_oracle_dump/rank0/init.safetensors", g_dir);
  ddp_st_file_t *fa = NULL, *fb = NULL;
  assert_int_equal(ddp_st_open(a, DDP_ST_READ, &fa, NULL), DDP_OK);
  assert_int_equal(ddp_st_open(b, DDP_ST_READ, &fb, NULL), DDP_OK);
  size_t n = ddp_st_count(fa), checked = 0;
  for (size_t i = 0; i < n; i++) {
    char want[300];
    snprintf(want, sizeof want, "param.%s", ddp_st_name(fa, i));
    size_t j;
    if (ddp_st_find(fb, want, &j) != DDP_OK) fail_msg("%s: no %s", b, want);
    ddp_tensor_t ta, tb;
    assert_int_equal(ddp_st_tensor(fa, i, &ta), DDP_OK);
    assert_int_equal(ddp_st_tensor(fb, j, &tb), DDP_OK);
    assert_int_equal(ta.numel, tb.numel);
    if (memcmp(ta.data, tb.data, ddp_tensor_nbytes(&ta)) != 0) {
      fail_msg("%s differs between the oracle's file and ddp-train's init dump", want);
    }
    checked++;
  }
  print_message("oracle-written %s: %zu tensors loaded bitwise by ddp-train\n", dir, checked);
  assert_int_equal(checked, 2 + 12 * 2 + 2); /* wte, wpe, 12 per block, ln_f */
  ddp_st_close(fa);
  ddp_st_close(fb);
}

static void test_resume_bitwise(void **state) {
  (void)state;
  const char *common = "--threads 2 --max_steps 8 --gradient_accumulation_steps 2 "
                       "--warmup_steps 2";
  char extra[1200], h1[64], h2[64];
  snprintf(extra, sizeof extra, "%s --save_steps 4", common);
  train_ok(NULL, NULL, "resume_full", extra);
  snprintf(extra, sizeof extra,
           "%s --save_strategy no --resume_from_checkpoint "
           "'%s/resume_full/checkpoint-4'",
           common, g_dir);
  train_ok(NULL, NULL, "resume_half", extra);
  summary_hash("resume_full", h1, sizeof h1);
  summary_hash("resume_half", h2, sizeof h2);
  print_message("8 steps: uninterrupted %s, resumed at step 4 %s\n", h1, h2);
  assert_string_equal(h1, h2);
  cJSON *s = summary("resume_half");
  assert_int_equal(ddp_test_json_get(s, "start_step")->valueint, 4);
  cJSON_Delete(s);
}

/* The same for the tiny Llama (untied head, GQA): saved at step 4 of 8 in 20KB shards
 * (--max_shard_size: model-0000K-of-0000N.safetensors and the index, checkpoint and final
 * model alike), resumed from the shards, the uninterrupted run's hash. */
static void test_llama_resume_bitwise(void **state) {
  (void)state;
  const char *common = "--threads 2 --max_steps 8 --gradient_accumulation_steps 2 "
                       "--warmup_steps 2 --ddp_find_unused_parameters false";
  char extra[1200], h1[64], h2[64];
  g_model = g_llama;
  snprintf(extra, sizeof extra, "%s --save_steps 4 --max_shard_size 20KB", common);
  train_ok(NULL, NULL, "llama_resume_full", extra);
  static const char *const where[] = {"llama_resume_full/checkpoint-4", "llama_resume_full"};
  for (size_t i = 0; i < 2; i++) {
    char p[900];
    struct stat sb;
    snprintf(p, sizeof p, "%s/%s/model.safetensors.index.json", g_dir, where[i]);
    if (stat(p, &sb) != 0) fail_msg("no %s", p);
    snprintf(p, sizeof p, "%s/%s/model.safetensors", g_dir, where[i]);
    assert_int_equal(stat(p, &sb), -1);
  }
  snprintf(extra, sizeof extra,
           "%s --save_strategy no --resume_from_checkpoint "
           "'%s/llama_resume_full/checkpoint-4'",
           common, g_dir);
  train_ok(NULL, NULL, "llama_resume_half", extra);
  g_model = g_cfg;
  summary_hash("llama_resume_full", h1, sizeof h1);
  summary_hash("llama_resume_half", h2, sizeof h2);
  print_message("Llama, 8 steps: uninterrupted %s, resumed at step 4 %s\n", h1, h2);
  assert_string_equal(h1, h2);
  cJSON *s = summary("llama_resume_half");
  assert_int_equal(ddp_test_json_get(s, "start_step")->valueint, 4);
  cJSON_Delete(s);
}

/* ---------------------------------------------------------------- eval, sample ---- */

static void test_learns_eval_and_sample(void **state) {
  (void)state;
  char *out = NULL;
  train_ok(&out, NULL, "learn",
           "--threads 2 --max_steps 40 --eval_strategy steps --eval_steps 20 "
           "--save_strategy no --sample_prompt 'the cat ' --sample_max_new_tokens 24");
  cJSON *s = summary("learn");
  double first = ddp_test_json_get(s, "first_loss")->valuedouble;
  double last = ddp_test_json_get(s, "last_loss")->valuedouble;
  double el = ddp_test_json_get(s, "eval_loss")->valuedouble;
  double ppl = ddp_test_json_get(s, "perplexity")->valuedouble;
  print_message("loss %.4f -> %.4f, eval_loss %.4f, perplexity %.3f\n", first, last, el, ppl);
  /* Bytes start near log(256) = 5.55; a 16-word vocabulary is learned quickly. */
  if (!(first > 5.0 && last < first - 1.5)) fail_msg("loss %g -> %g did not fall", first, last);
  if (fabs(ppl - exp(el)) > 1e-6 * exp(el)) fail_msg("perplexity %.9g != exp(%.9g)", ppl, el);
  cJSON_Delete(s);
  /* Every eval line carries perplexity too. */
  char path[800], line[4096];
  snprintf(path, sizeof path, "%s/learn/metrics.jsonl", g_dir);
  FILE *f = fopen(path, "r");
  assert_non_null(f);
  int evals = 0;
  while (fgets(line, sizeof line, f)) {
    cJSON *o = cJSON_Parse(line);
    const cJSON *e = o ? cJSON_GetObjectItem(o, "eval_loss") : NULL;
    if (e && !cJSON_GetObjectItem(o, "summary")) {
      double p = ddp_test_json_get(o, "perplexity")->valuedouble;
      if (fabs(p - exp(e->valuedouble)) > 1e-6 * p) fail_msg("eval line: %s", line);
      evals++;
    }
    cJSON_Delete(o);
  }
  fclose(f);
  assert_int_equal(evals, 2);
  /* The summary on stdout: perplexity and a sample continuing the prompt. */
  const char *sm = out ? strstr(out, "ddp-train: sample (greedy, 24 new tokens") : NULL;
  if (!sm || !strstr(out, "perplexity") || !strstr(sm, "\nthe cat ")) {
    fail_msg("stdout lacks the perplexity or the sample: %s", out ? out : "");
  }
  print_message("%s", sm);
  free(out);
}

/* ddp_generate directly: deterministic greedy and seeded top-k, top-k 1 = greedy, the
 * context cropped to n_positions, and its errors. */
static void test_generate(void **state) {
  (void)state;
  ddp_model_t *m = NULL;
  ddp_error_t err = {0};
  if (ddp_model_from_json(GPT2, &m, &err) != DDP_OK) fail_msg("%s", err.msg);
  assert_int_equal(ddp_model_init(m, 3), DDP_OK);
  int64_t prompt[100];
  for (int i = 0; i < 100; i++) prompt[i] = (i * 37 + 11) % 256;
  ddp_generate_options_t o = DDP_GENERATE_OPTIONS_INIT;
  o.max_new_tokens = 8;
  int64_t *a = NULL, *b = NULL, na = 0, nb = 0;
  /* 100 prompt tokens: more than n_positions 64, so the context is cropped. */
  assert_int_equal(ddp_generate(m, prompt, 100, &o, &a, &na, &err), DDP_OK);
  assert_int_equal(na, 8);
  assert_int_equal(ddp_generate(m, prompt, 100, &o, &b, &nb, &err), DDP_OK);
  assert_memory_equal(a, b, sizeof *a * 8);
  /* The last 64 tokens alone give the same first token (what the crop means). */
  int64_t *c = NULL, nc = 0;
  o.max_new_tokens = 1;
  assert_int_equal(ddp_generate(m, prompt + 36, 64, &o, &c, &nc, &err), DDP_OK);
  assert_int_equal(c[0], a[0]);
  ddp_free(c);
  ddp_free(b);
  /* top-k 1 is greedy; top-k 50 with a seed repeats itself; another seed differs. */
  o.max_new_tokens = 8;
  o.top_k = 1;
  assert_int_equal(ddp_generate(m, prompt, 100, &o, &b, &nb, &err), DDP_OK);
  assert_memory_equal(a, b, sizeof *a * 8);
  ddp_free(b);
  o.top_k = 50;
  o.seed = 1;
  int64_t *k1 = NULL, *k2 = NULL, *k3 = NULL, n1, n2, n3;
  assert_int_equal(ddp_generate(m, prompt, 10, &o, &k1, &n1, &err), DDP_OK);
  assert_int_equal(ddp_generate(m, prompt, 10, &o, &k2, &n2, &err), DDP_OK);
  o.seed = 2;
  assert_int_equal(ddp_generate(m, prompt, 10, &o, &k3, &n3, &err), DDP_OK);
  assert_memory_equal(k1, k2, sizeof *k1 * 8);
  assert_true(memcmp(k1, k3, sizeof *k1 * 8) != 0);
  for (int i = 0; i < 8; i++) assert_true(k1[i] >= 0 && k1[i] < 256);
  ddp_free(k1);
  ddp_free(k2);
  ddp_free(k3);
  ddp_free(a);
  /* Errors: an empty prompt, an id beyond the vocabulary, a model that is no causal LM. */
  assert_int_equal(ddp_generate(m, prompt, 0, &o, &a, &na, &err), DDP_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(err.msg, "prompt is empty"));
  int64_t bad = 300;
  assert_int_not_equal(ddp_generate(m, &bad, 1, &o, &a, &na, &err), DDP_OK);
  assert_non_null(strstr(err.msg, "300"));
  assert_null(a);
  ddp_model_destroy(m);
  assert_int_equal(ddp_model_from_json("{\"dtype\": \"f32\", \"layers\": [{\"type\": "
                                       "\"linear\", \"in\": 4, \"out\": 3}]}",
                                       &m, &err),
                   DDP_OK);
  o.context = 4;
  assert_int_not_equal(ddp_generate(m, prompt, 4, &o, &a, &na, &err), DDP_OK);
  ddp_model_destroy(m);
}

/* ---------------------------------------------------------------- bad input ------- */

static void expect_exit(const char *what, int want, const char *needle, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void expect_exit(const char *what, int want, const char *needle, const char *fmt, ...) {
  char cmd[4096];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(cmd, sizeof cmd, fmt, ap);
  va_end(ap);
  int rc = ddp_test_run_cmd(NULL, "%s", cmd);
  char *err = ddp_test_cmd_stderr();
  if (rc != want || !err || !strstr(err, needle)) {
    fail_msg("%s: exit %d (want %d), stderr lacks \"%s\": %s", what, rc, want, needle,
             err ? err : "");
  }
  print_message("%-28s exit %d: %.*s\n", what, rc, (int)strcspn(err, "\n"), err);
  free(err);
}

static void test_bad_input(void **state) {
  (void)state;
  setup_files();
  char p[900], tiny_vocab[900], bad_div[900], unknown[900], bin[900], bert[900], csv[900];
  const char *base = "OMP_NUM_THREADS=1";
  snprintf(tiny_vocab, sizeof tiny_vocab, "%s/vocab100.json", g_dir);
  ddp_test_write_text(tiny_vocab, "{\"model_type\": \"gpt2\", \"n_layer\": 1, \"n_embd\": 16, "
                                  "\"n_head\": 2, \"vocab_size\": 100, \"n_positions\": 64}");
  snprintf(bad_div, sizeof bad_div, "%s/div.json", g_dir);
  ddp_test_write_text(bad_div, "{\"model_type\": \"gpt2\", \"n_layer\": 1, \"n_embd\": 30, "
                               "\"n_head\": 4, \"vocab_size\": 256, \"n_positions\": 64}");
  snprintf(unknown, sizeof unknown, "%s/unknown.json", g_dir);
  ddp_test_write_text(unknown, "{\"model_type\": \"t5\", \"hidden_size\": 16}");
  snprintf(bert, sizeof bert, "%s/bert.json", g_dir);
  ddp_test_write_text(bert, "{\"model_type\": \"bert\", \"num_hidden_layers\": 1, "
                            "\"hidden_size\": 16, \"num_attention_heads\": 2, "
                            "\"intermediate_size\": 32, \"vocab_size\": 256, "
                            "\"max_position_embeddings\": 32}");
  snprintf(csv, sizeof csv, "%s/texts.csv", g_dir);
  ddp_test_write_text(csv, "text,label\nhello,1\nworld,0\n");
  /* A llm.c token file whose header promises more tokens than it holds. */
  snprintf(bin, sizeof bin, "%s/truncated.bin", g_dir);
  FILE *f = fopen(bin, "wb");
  assert_non_null(f);
  int32_t hdr[256] = {20240520, 1, 1000};
  uint16_t toks[10] = {1, 2, 3};
  fwrite(hdr, sizeof hdr, 1, f);
  fwrite(toks, sizeof toks, 1, f);
  fclose(f);

  expect_exit("block_size 0", 2, "--block_size", "%s '%s' --model '%s' --data '%s' --block_size 0",
              base, g_train, g_cfg, g_corpus);
  expect_exit("sample_top_k -1", 2, "--sample_top_k",
              "%s '%s' --model '%s' --data '%s' --sample_top_k -1", base, g_train, g_cfg, g_corpus);
  expect_exit("missing data", 2, "nonexistent.txt",
              "%s '%s' --model '%s' --data '%s/nonexistent.txt'", base, g_train, g_cfg, g_dir);
  expect_exit("n_embd % n_head", 2, "n_head", "%s '%s' --model '%s' --data '%s'", base, g_train,
              bad_div, g_corpus);
  expect_exit("unknown model_type", 2, "t5", "%s '%s' --model '%s' --data '%s'", base, g_train,
              unknown, g_corpus);
  expect_exit("block longer than n_positions", 1, "n_positions",
              "%s '%s' --model '%s' --data '%s' --block_size 65", base, g_train, g_cfg, g_corpus);
  expect_exit("token beyond vocabulary", 1, "100",
              "%s '%s' --model '%s' --data '%s' --block_size 32 --max_steps 1", base, g_train,
              tiny_vocab, g_corpus);
  expect_exit("truncated token file", 1, "truncated.bin",
              "%s '%s' --model '%s' --data '%s' --block_size 32 --max_steps 1", base, g_train,
              g_cfg, bin);
  expect_exit("BERT max_seq_length", 1, "max_position_embeddings",
              "%s '%s' --model '%s' --data '%s' --max_seq_length 33", base, g_train, bert, csv);
  expect_exit("BERT on a text file", 2, "text,label", "%s '%s' --model '%s' --data '%s'", base,
              g_train, bert, g_corpus);
  /* A checkpoint directory missing a key (PyTorch's wording: "Missing key(s)"). */
  snprintf(p, sizeof p, "%s/ckpt_missing", g_dir);
  assert_int_equal(mkdir(p, 0755), 0);
  char cfgp[1000], st[1000];
  snprintf(cfgp, sizeof cfgp, "%s/config.json", p);
  ddp_test_write_text(cfgp, GPT2);
  snprintf(st, sizeof st, "%s/model.safetensors", p);
  float z[64] = {0};
  int64_t sh[1] = {64};
  ddp_tensor_t t;
  ddp_tensor_view(&t, DDP_F32, 1, sh, z);
  ddp_st_entry_t e = {"transformer.ln_f.weight", &t};
  assert_int_equal(ddp_st_write(st, &e, 1, NULL, NULL, 0, NULL), DDP_OK);
  expect_exit("checkpoint missing keys", 1, "issing key",
              "%s '%s' --model_name_or_path '%s' --data '%s'", base, g_train, p, g_corpus);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_llama),
      cmocka_unit_test(test_llama_invariant),
      cmocka_unit_test(test_llama_llmc_tokens),
      cmocka_unit_test(test_llama_resume_bitwise),
      cmocka_unit_test(test_generate),
      cmocka_unit_test(test_bad_input),
      cmocka_unit_test(test_learns_eval_and_sample),
      cmocka_unit_test(test_resume_bitwise),
      cmocka_unit_test(test_determinism),
      cmocka_unit_test(test_checkpoint_to_oracle),
      cmocka_unit_test(test_oracle_to_libddp),
  };
  return ddp_test_parity_main("train_text", tests, sizeof tests / sizeof *tests);
}
