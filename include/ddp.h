/* libddp: PyTorch-style DistributedDataParallel in C11 for CPUs. The umbrella header:
 * one public header per layer, from the bottom up (docs/design.md). */
#ifndef DDP_H
#define DDP_H

#include "ddp/common.h"
#include "ddp/tensor.h"
#include "ddp/io.h"
#include "ddp/store.h"
#include "ddp/pg.h"
#include "ddp/nn.h"
#include "ddp/optim.h"
#include "ddp/data.h"
#include "ddp/reducer.h"
#include "ddp/shard.h"
#include "ddp/hooks.h"
#include "ddp/train.h"

#endif /* DDP_H */
