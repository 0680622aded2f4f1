/* The TCP store's wire format (layout in store_internal.h and docs/rendezvous.md): header
 * and body checks and message building. Pure functions over byte buffers, so that a fuzz
 * target can drive them directly.
 *
 * A header is judged alone, before any body byte is read or buffered: every op has a fixed
 * range of field counts and a largest body, computed from DDP_STORE_MAX_KEY and
 * DDP_STORE_MAX_VALUE, so an oversized length is refused after 12 bytes. The body is then
 * split into fields that must fill it exactly, and every field is checked against what its
 * position in that op holds (a key, a value, an 8-byte integer, the token). */
#include <stdio.h>
#include <string.h>

#include "store/store_internal.h"

uint32_t ddp__wire_get_u32(const unsigned char *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

void ddp__wire_put_u32(unsigned char *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}

uint64_t ddp__wire_get_u64(const unsigned char *p) {
  return (uint64_t)ddp__wire_get_u32(p) | (uint64_t)ddp__wire_get_u32(p + 4) << 32;
}

void ddp__wire_put_u64(unsigned char *p, uint64_t v) {
  ddp__wire_put_u32(p, (uint32_t)v);
  ddp__wire_put_u32(p + 4, (uint32_t)(v >> 32));
}

/* What a field at a position holds. */
typedef enum field_kind { F_KEY, F_VALUE, F_U64, F_U32, F_TOKEN, F_U8, F_TEXT } field_kind_t;

#define KEYF ((uint64_t)DDP_STORE_MAX_KEY + 4)
#define VALF ((uint64_t)DDP_STORE_MAX_VALUE + 4)

/* Request ops: field count range, largest body, and the kind of each field (WAIT: field 0
 * is the timeout, the rest keys; CHECK: all keys). */
static bool request_shape(unsigned op, unsigned *min_f, unsigned *max_f, uint64_t *max_body) {
  switch (op) {
    case DDP__OP_HELLO:
      *min_f = *max_f = 2;
      *max_body = 8 + 4 + DDP__WIRE_MAX_TOKEN;
      return true;
    case DDP__OP_SET:
      *min_f = *max_f = 2;
      *max_body = KEYF + VALF;
      return true;
    case DDP__OP_GET:
      *min_f = *max_f = 2;
      *max_body = KEYF + 12;
      return true;
    case DDP__OP_ADD:
      *min_f = *max_f = 2;
      *max_body = KEYF + 12;
      return true;
    case DDP__OP_WAIT:
      *min_f = 1;
      *max_f = DDP_STORE_MAX_WAIT_KEYS + 1;
      *max_body = 12 + (uint64_t)DDP_STORE_MAX_WAIT_KEYS * KEYF;
      return true;
    case DDP__OP_CHECK:
      *min_f = 0;
      *max_f = DDP_STORE_MAX_WAIT_KEYS;
      *max_body = (uint64_t)DDP_STORE_MAX_WAIT_KEYS * KEYF;
      return true;
    case DDP__OP_CSET:
      *min_f = *max_f = 3;
      *max_body = KEYF + 2 * VALF;
      return true;
    case DDP__OP_DELETE:
      *min_f = *max_f = 1;
      *max_body = KEYF;
      return true;
    case DDP__OP_NUMKEYS:
      *min_f = *max_f = 0;
      *max_body = 0;
      return true;
    default: return false;
  }
}

static field_kind_t request_field(unsigned op, unsigned i) {
  switch (op) {
    case DDP__OP_HELLO: return i == 0 ? F_U32 : F_TOKEN;
    case DDP__OP_SET: return i == 0 ? F_KEY : F_VALUE;
    case DDP__OP_GET: return i == 0 ? F_KEY : F_U64;
    case DDP__OP_ADD: return i == 0 ? F_KEY : F_U64;
    case DDP__OP_WAIT: return i == 0 ? F_U64 : F_KEY;
    case DDP__OP_CSET: return i == 0 ? F_KEY : F_VALUE;
    default: return F_KEY;
  }
}

static bool field_ok(field_kind_t k, uint32_t len) {
  switch (k) {
    case F_KEY: return len <= DDP_STORE_MAX_KEY;
    case F_VALUE: return len <= DDP_STORE_MAX_VALUE;
    case F_U64: return len == 8;
    case F_U32: return len == 4;
    case F_U8: return len == 1;
    case F_TOKEN: return len <= DDP__WIRE_MAX_TOKEN;
    case F_TEXT: return len <= DDP_ERROR_MSG_MAX;
  }
  return false;
}

static const char *kind_name(field_kind_t k) {
  switch (k) {
    case F_KEY: return "key";
    case F_VALUE: return "value";
    case F_U64: return "8-byte integer";
    case F_U32: return "4-byte integer";
    case F_U8: return "1-byte flag";
    case F_TOKEN: return "token";
    case F_TEXT: return "error text";
  }
  return "field";
}

static bool parse_hdr(const unsigned char *p, ddp__wire_hdr_t *h, char *why, size_t cap) {
  uint32_t magic = ddp__wire_get_u32(p);
  if (magic != DDP__WIRE_MAGIC) {
    snprintf(why, cap, "bad magic 0x%08x (expected 0x%08x, \"DDPS\")", magic, DDP__WIRE_MAGIC);
    return false;
  }
  if (p[6] != 0 || p[7] != 0) {
    snprintf(why, cap, "reserved header bytes are not zero");
    return false;
  }
  h->code = p[4];
  h->nfields = p[5] | 0u;
  h->body_len = ddp__wire_get_u32(p + 8);
  return true;
}

/* The field count does not fit in one byte for WAIT/CHECK with many keys, so byte 5 holds
 * the count modulo 256 and the body parse recounts: the header check uses body bounds. */
bool ddp__wire_parse_request_hdr(const unsigned char *p, ddp__wire_hdr_t *h, char *why,
                                 size_t cap) {
  if (!parse_hdr(p, h, why, cap)) return false;
  unsigned min_f, max_f;
  uint64_t max_body;
  if (!request_shape(h->code, &min_f, &max_f, &max_body)) {
    snprintf(why, cap, "unknown op %u", h->code);
    return false;
  }
  if (h->body_len > max_body) {
    snprintf(why, cap, "body length %u exceeds the limit %llu for op %u", h->body_len,
             (unsigned long long)max_body, h->code);
    return false;
  }
  if (max_f < 256 && (h->nfields < min_f || h->nfields > max_f)) {
    snprintf(why, cap, "op %u with %u fields (expected %u..%u)", h->code, h->nfields, min_f, max_f);
    return false;
  }
  return true;
}

bool ddp__wire_parse_response_hdr(const unsigned char *p, ddp__wire_hdr_t *h, char *why,
                                  size_t cap) {
  if (!parse_hdr(p, h, why, cap)) return false;
  if (h->code >= (unsigned)DDP_STATUS_COUNT_) {
    snprintf(why, cap, "unknown status %u", h->code);
    return false;
  }
  if (h->nfields > 1 || h->body_len > VALF) {
    snprintf(why, cap, "response with %u fields and %u body bytes", h->nfields, h->body_len);
    return false;
  }
  return true;
}

bool ddp__wire_parse_body(const ddp__wire_hdr_t *h, const unsigned char *body, bool request,
                          ddp__wire_msg_t *m, char *why, size_t cap) {
  unsigned min_f = 0, max_f = 1;
  uint64_t max_body = 0;
  if (request) request_shape(h->code, &min_f, &max_f, &max_body);
  m->op = h->code;
  m->nfields = 0;
  size_t off = 0;
  while (off < h->body_len) {
    if (m->nfields >= max_f) {
      snprintf(why, cap, "more than %u fields", max_f);
      return false;
    }
    if (h->body_len - off < 4) {
      snprintf(why, cap, "truncated field length at body offset %zu", off);
      return false;
    }
    uint32_t len = ddp__wire_get_u32(body + off);
    off += 4;
    if (len > h->body_len - off) {
      snprintf(why, cap, "field %u of %u bytes runs past the body end", m->nfields, len);
      return false;
    }
    field_kind_t k = request ? request_field(h->code, m->nfields)
                             : (h->code == DDP_OK ? F_VALUE : F_TEXT);
    if (!field_ok(k, len)) {
      snprintf(why, cap, "field %u (%s) has a bad length %u", m->nfields, kind_name(k), len);
      return false;
    }
    m->field[m->nfields] = body + off;
    m->len[m->nfields] = len;
    m->nfields++;
    off += len;
  }
  if (m->nfields < min_f || (m->nfields & 0xffu) != (h->nfields & 0xffu)) {
    snprintf(why, cap, "%u fields in the body, header says %u", m->nfields, h->nfields);
    return false;
  }
  return true;
}

ddp_status_t ddp__wire_build(unsigned code, unsigned nfields, const void *const *field,
                             const uint32_t *len, unsigned char **out, size_t *out_n) {
  size_t body = 0;
  for (unsigned i = 0; i < nfields; i++) body += 4 + (size_t)len[i];
  if (body > UINT32_MAX) return DDP_ERR_INVALID_ARGUMENT;
  unsigned char *b = ddp__malloc(DDP__WIRE_HDR + body);
  if (!b) return DDP_ERR_NO_MEMORY;
  ddp__wire_put_u32(b, DDP__WIRE_MAGIC);
  b[4] = (unsigned char)code;
  b[5] = (unsigned char)(nfields & 0xffu);
  b[6] = b[7] = 0;
  ddp__wire_put_u32(b + 8, (uint32_t)body);
  size_t off = DDP__WIRE_HDR;
  for (unsigned i = 0; i < nfields; i++) {
    ddp__wire_put_u32(b + off, len[i]);
    off += 4;
    if (len[i]) memcpy(b + off, field[i], len[i]);
    off += len[i];
  }
  *out = b;
  *out_n = off;
  return DDP_OK;
}
