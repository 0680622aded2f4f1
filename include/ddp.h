/* libddp: PyTorch-style DistributedDataParallel in C11 for CPUs. The umbrella header:
 * one public header per layer, from the bottom up (docs/design.md). */
#ifndef DDP_H
#define DDP_H

#include "ddp/common.h"
#include "ddp/tensor.h"
#include "ddp/io.h"

#endif /* DDP_H */
