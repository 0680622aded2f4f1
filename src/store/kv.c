/* The key/value table behind the in-memory store and the TCP server: separate chaining,
 * FNV-1a hashes, power-of-two bucket counts that double when the load passes 1. Keys and
 * values are copied in; the table owns them. */
#include <stdio.h>
#include <string.h>

#include "store/store_internal.h"

static uint64_t fnv1a(const char *p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; i++) {
    h ^= (unsigned char)p[i];
    h *= 1099511628211ull;
  }
  return h;
}

ddp_status_t ddp__kv_init(ddp__kv_t *kv) {
  kv->nbuckets = 64;
  kv->count = 0;
  kv->buckets = ddp__calloc(kv->nbuckets, sizeof *kv->buckets);
  return kv->buckets ? DDP_OK : DDP_ERR_NO_MEMORY;
}

static void entry_free(ddp__kv_entry_t *e) {
  ddp__free(e->key);
  ddp__free(e->val);
  ddp__free(e);
}

void ddp__kv_fini(ddp__kv_t *kv) {
  if (!kv->buckets) return;
  for (size_t i = 0; i < kv->nbuckets; i++) {
    ddp__kv_entry_t *e = kv->buckets[i];
    while (e) {
      ddp__kv_entry_t *next = e->next;
      entry_free(e);
      e = next;
    }
  }
  ddp__free(kv->buckets);
  kv->buckets = NULL;
  kv->count = 0;
}

ddp__kv_entry_t *ddp__kv_find(const ddp__kv_t *kv, const char *key, size_t key_len) {
  uint64_t h = fnv1a(key, key_len);
  for (ddp__kv_entry_t *e = kv->buckets[h & (kv->nbuckets - 1)]; e; e = e->next) {
    if (e->hash == h && e->key_len == key_len && memcmp(e->key, key, key_len) == 0) return e;
  }
  return NULL;
}

/* Doubling is best effort: when it cannot allocate, chains just grow longer. */
static void maybe_grow(ddp__kv_t *kv) {
  if (kv->count < kv->nbuckets) return;
  size_t nb = kv->nbuckets * 2;
  ddp__kv_entry_t **b = ddp__calloc(nb, sizeof *b);
  if (!b) return;
  for (size_t i = 0; i < kv->nbuckets; i++) {
    ddp__kv_entry_t *e = kv->buckets[i];
    while (e) {
      ddp__kv_entry_t *next = e->next;
      e->next = b[e->hash & (nb - 1)];
      b[e->hash & (nb - 1)] = e;
      e = next;
    }
  }
  ddp__free(kv->buckets);
  kv->buckets = b;
  kv->nbuckets = nb;
}

ddp_status_t ddp__kv_put(ddp__kv_t *kv, const char *key, size_t key_len, const void *v, size_t n) {
  unsigned char *val = ddp__malloc(n);
  if (!val) return DDP_ERR_NO_MEMORY;
  if (n) memcpy(val, v, n);
  ddp__kv_entry_t *e = ddp__kv_find(kv, key, key_len);
  if (e) {
    ddp__free(e->val);
    e->val = val;
    e->val_len = n;
    return DDP_OK;
  }
  e = ddp__calloc(1, sizeof *e);
  char *k = ddp__malloc(key_len + 1);
  if (!e || !k) {
    ddp__free(e);
    ddp__free(k);
    ddp__free(val);
    return DDP_ERR_NO_MEMORY;
  }
  memcpy(k, key, key_len);
  k[key_len] = '\0';
  e->key = k;
  e->key_len = key_len;
  e->hash = fnv1a(key, key_len);
  e->val = val;
  e->val_len = n;
  size_t b = e->hash & (kv->nbuckets - 1);
  e->next = kv->buckets[b];
  kv->buckets[b] = e;
  kv->count++;
  maybe_grow(kv);
  return DDP_OK;
}

bool ddp__kv_del(ddp__kv_t *kv, const char *key, size_t key_len) {
  uint64_t h = fnv1a(key, key_len);
  ddp__kv_entry_t **pp = &kv->buckets[h & (kv->nbuckets - 1)];
  for (; *pp; pp = &(*pp)->next) {
    ddp__kv_entry_t *e = *pp;
    if (e->hash == h && e->key_len == key_len && memcmp(e->key, key, key_len) == 0) {
      *pp = e->next;
      entry_free(e);
      kv->count--;
      return true;
    }
  }
  return false;
}

ddp_status_t ddp__kv_add(ddp__kv_t *kv, const char *key, size_t key_len, int64_t delta,
                         int64_t *result, char *why, size_t cap) {
  int64_t cur = 0;
  ddp__kv_entry_t *e = ddp__kv_find(kv, key, key_len);
  if (e && !ddp__store_parse_i64(e->val, e->val_len, &cur)) {
    snprintf(why, cap, "the value at key '%.200s' (%zu bytes) is not a decimal integer", key,
             e->val_len);
    return DDP_ERR_INVALID_USAGE;
  }
  int64_t r;
  if (!ddp__store_add_i64(cur, delta, &r)) {
    snprintf(why, cap, "add(%lld) to key '%.200s' holding %lld overflows int64", (long long)delta,
             key, (long long)cur);
    return DDP_ERR_INVALID_ARGUMENT;
  }
  char buf[24];
  int n = snprintf(buf, sizeof buf, "%lld", (long long)r);
  if (ddp__kv_put(kv, key, key_len, buf, (size_t)n) != DDP_OK) {
    snprintf(why, cap, "out of memory");
    return DDP_ERR_NO_MEMORY;
  }
  *result = r;
  return DDP_OK;
}

ddp_status_t ddp__kv_cset(ddp__kv_t *kv, const char *key, size_t key_len, const void *exp,
                          size_t exp_n, const void *des, size_t des_n,
                          const ddp__kv_entry_t **after) {
  ddp__kv_entry_t *e = ddp__kv_find(kv, key, key_len);
  bool match = e ? (e->val_len == exp_n && (exp_n == 0 || memcmp(e->val, exp, exp_n) == 0))
                 : exp_n == 0;
  if (match) {
    ddp_status_t st = ddp__kv_put(kv, key, key_len, des, des_n);
    if (st != DDP_OK) return st;
    e = ddp__kv_find(kv, key, key_len);
  }
  *after = e;
  return DDP_OK;
}
