// c10d's Store as a libddp store (ddp_store_create_callbacks): the libddp group rendezvous
// through the store PyTorch hands every backend (a PrefixStore over the job's TCPStore,
// FileStore or HashStore), so init_method, store= and torchrun's agent store all work
// unchanged. Every callback is non-blocking (check, then get); libddp does the waiting.
#include "store_bridge.hpp"

#include <cstring>

namespace libddp_torch {
namespace {

c10d::Store *st(void *ctx) { return static_cast<c10d::Store *>(ctx); }

ddp_status_t caught(ddp_error_t *err, const char *what, const std::exception &e) {
  err->status = DDP_ERR_REMOTE;
  snprintf(err->msg, sizeof err->msg, "c10d store %s: %s", what, e.what());
  return DDP_ERR_REMOTE;
}

ddp_status_t cb_set(void *ctx, const char *key, const void *v, size_t n, ddp_error_t *err) {
  try {
    const uint8_t *p = static_cast<const uint8_t *>(v);
    st(ctx)->set(key, std::vector<uint8_t>(p, p + n));
    return DDP_OK;
  } catch (const std::exception &e) {
    return caught(err, "set", e);
  }
}

void *dup(const std::vector<uint8_t> &v) {
  void *p = ddp_malloc(v.size() ? v.size() : 1);
  if (p && !v.empty()) memcpy(p, v.data(), v.size());
  return p;
}

ddp_status_t cb_get(void *ctx, const char *key, bool *found, void **v, size_t *n,
                    ddp_error_t *err) {
  try {
    *found = st(ctx)->check({key});
    if (!*found) return DDP_OK;
    std::vector<uint8_t> val = st(ctx)->get(key);
    *v = dup(val);
    if (!*v) {
      err->status = DDP_ERR_NO_MEMORY;
      snprintf(err->msg, sizeof err->msg, "out of memory for a %zu-byte value", val.size());
      return DDP_ERR_NO_MEMORY;
    }
    *n = val.size();
    return DDP_OK;
  } catch (const std::exception &e) {
    return caught(err, "get", e);
  }
}

ddp_status_t cb_add(void *ctx, const char *key, int64_t delta, int64_t *result,
                    ddp_error_t *err) {
  try {
    *result = st(ctx)->add(key, delta);
    return DDP_OK;
  } catch (const std::exception &e) {
    return caught(err, "add", e);
  }
}

ddp_status_t cb_check(void *ctx, const char *const *keys, size_t nkeys, bool *all,
                      ddp_error_t *err) {
  try {
    std::vector<std::string> k(keys, keys + nkeys);
    *all = st(ctx)->check(k);
    return DDP_OK;
  } catch (const std::exception &e) {
    return caught(err, "check", e);
  }
}

ddp_status_t cb_del(void *ctx, const char *key, bool *deleted, ddp_error_t *err) {
  try {
    *deleted = st(ctx)->deleteKey(key);
    return DDP_OK;
  } catch (const std::exception &e) {
    return caught(err, "delete", e);
  }
}

ddp_status_t cb_num_keys(void *ctx, int64_t *n, ddp_error_t *err) {
  try {
    *n = st(ctx)->getNumKeys();
    return DDP_OK;
  } catch (const std::exception &e) {
    return caught(err, "num_keys", e);
  }
}

ddp_status_t cb_cset(void *ctx, const char *key, const void *exp, size_t exp_n, const void *des,
                     size_t des_n, void **actual, size_t *act_n, ddp_error_t *err) {
  try {
    const uint8_t *e = static_cast<const uint8_t *>(exp), *d = static_cast<const uint8_t *>(des);
    std::vector<uint8_t> r = st(ctx)->compareSet(key, std::vector<uint8_t>(e, e + exp_n),
                                                 std::vector<uint8_t>(d, d + des_n));
    *actual = dup(r);
    *act_n = r.size();
    return *actual ? DDP_OK : DDP_ERR_NO_MEMORY;
  } catch (const std::exception &e) {
    return caught(err, "compare_set", e);
  }
}

} // namespace

ddp_status_t make_ddp_store(c10d::Store *store, int rank, int64_t timeout_ms, ddp_store_t **out,
                            ddp_error_t *err) {
  ddp_store_callbacks_t cb = {};
  cb.struct_size = sizeof cb;
  cb.ctx = store;
  cb.desc = "the c10d store of the process group";
  cb.set = cb_set;
  cb.get = cb_get;
  cb.add = cb_add;
  cb.check = cb_check;
  cb.del = cb_del;
  cb.num_keys = cb_num_keys;
  cb.compare_set = cb_cset;
  ddp_store_options_t o = DDP_STORE_OPTIONS_INIT;
  o.timeout_ms = timeout_ms;
  o.rank = rank;
  return ddp_store_create_callbacks(&cb, &o, out, err);
}

} // namespace libddp_torch
