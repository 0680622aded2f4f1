// c10d::Store -> ddp_store_t (store_bridge.cpp).
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "ddp/store.h"

namespace libddp_torch {

// A libddp store whose operations go to `store` (borrowed: it must outlive the result).
ddp_status_t make_ddp_store(c10d::Store *store, int rank, int64_t timeout_ms, ddp_store_t **out,
                            ddp_error_t *err);

} // namespace libddp_torch
