/* What the store layer tells the backends about the network: the one store internal that
 * is used outside src/store. Not installed. */
#ifndef DDP_SRC_STORE_LOCAL_ADDR_H
#define DDP_SRC_STORE_LOCAL_ADDR_H

#include <stdbool.h>
#include <stddef.h>

#include "ddp/store.h"

/* Copies into buf the numeric local address (no port) of s's connection to its TCP store
 * server: the address the kernel chose to reach node 0, hence one that hosts on node 0's
 * network can reach this host at. s may be a prefix view. Returns false (buf = "") for
 * memory and file stores, for a server created on a wildcard address (its own client then
 * goes over loopback), and when the address does not fit in cap bytes. Thread-safe: the
 * address is fixed at create. */
bool ddp__store_local_addr(const ddp_store_t *s, char *buf, size_t cap);

#endif /* DDP_SRC_STORE_LOCAL_ADDR_H */
