/* PyTorch 1.13's TCPStore requests, parsed for the TCP store server (tcp_server.c), which
 * serves them beside libddp's own protocol when ddprun runs the job's store: a PyTorch
 * script's ranks, told TORCHELASTIC_USE_AGENT_STORE=True, connect to it as torchrun's agent
 * store. The format was read off 1.13's client on the wire (docs/rendezvous.md): one
 * query-type byte, then the fields; strings are a u64 length and the bytes. */
#include <string.h>

#include "store/store_internal.h"

typedef struct cursor {
  const unsigned char *p;
  size_t n, off;
} cursor_t;

/* 1: *v read; 0: not all here yet. */
static int get_u64(cursor_t *c, uint64_t *v) {
  if (c->n - c->off < 8) return 0;
  *v = ddp__wire_get_u64(c->p + c->off);
  c->off += 8;
  return 1;
}

/* 1: a string of at most max bytes read into r; 0: incomplete; -1: too long. */
static int get_str(cursor_t *c, ddp__torch_req_t *r, uint64_t max, const char *what, char *why,
                   size_t cap) {
  uint64_t len;
  if (!get_u64(c, &len)) return 0;
  if (len > max) {
    snprintf(why, cap, "PyTorch TCPStore request: a %s of %llu bytes (the limit is %llu)", what,
             (unsigned long long)len, (unsigned long long)max);
    return -1;
  }
  if (c->n - c->off < len) return 0;
  r->str[r->nstr] = c->p + c->off;
  r->len[r->nstr++] = (size_t)len;
  c->off += (size_t)len;
  return 1;
}

int ddp__torch_parse(const unsigned char *in, size_t n, ddp__torch_req_t *r, size_t *used,
                     char *why, size_t cap) {
  if (n == 0) return 0;
  cursor_t c = {in, n, 1};
  r->op = in[0];
  r->nstr = 0;
  r->delta = 0;
  int k = 1;
  switch (r->op) {
    case DDP__TORCH_SET:
    case DDP__TORCH_COMPARE_SET: {
      int values = r->op == DDP__TORCH_SET ? 1 : 2;
      k = get_str(&c, r, DDP_STORE_MAX_KEY, "key", why, cap);
      for (int i = 0; i < values && k == 1; i++)
        k = get_str(&c, r, DDP_STORE_MAX_VALUE, "value", why, cap);
      break;
    }
    case DDP__TORCH_GET:
    case DDP__TORCH_WATCH_KEY:
    case DDP__TORCH_DELETE_KEY: k = get_str(&c, r, DDP_STORE_MAX_KEY, "key", why, cap); break;
    case DDP__TORCH_ADD: {
      uint64_t d = 0;
      k = get_str(&c, r, DDP_STORE_MAX_KEY, "key", why, cap);
      if (k == 1) k = get_u64(&c, &d);
      r->delta = (int64_t)d;
      break;
    }
    case DDP__TORCH_CHECK:
    case DDP__TORCH_WAIT: {
      uint64_t nk;
      if (!get_u64(&c, &nk)) return 0;
      if (nk == 0 || nk > DDP_STORE_MAX_WAIT_KEYS) {
        snprintf(why, cap, "PyTorch TCPStore request: %llu keys in a %s (1 to %d allowed)",
                 (unsigned long long)nk, r->op == DDP__TORCH_WAIT ? "wait" : "check",
                 DDP_STORE_MAX_WAIT_KEYS);
        return -1;
      }
      for (uint64_t i = 0; i < nk && k == 1; i++)
        k = get_str(&c, r, DDP_STORE_MAX_KEY, "key", why, cap);
      break;
    }
    case DDP__TORCH_GETNUMKEYS: break;
    default: snprintf(why, cap, "unknown PyTorch TCPStore query type %u", r->op); return -1;
  }
  if (k != 1) return k;
  *used = c.off;
  return 1;
}
