// tessera/attention/cuda/estimate_kernels.cuh — the device estimators' kernels, their parameters and the BS
// scoring plan (device code of estimate_cuda.cu, which launches them; contract: estimate_cuda.h; overview:
// estimate_cuda.cu), by concern:
//   vs_estimate_kernels.cuh  VS scoring passes: row statistics, column and diagonal sums
//   vs_select_kernels.cuh    VS selection: top-k and adaptive counts of columns and offsets
//   bs_score_kernels.cuh     BS pooling and scoring, and the host plan of the scoring waves
//   bs_select_kernels.cuh    BS selection: adaptive counts and the top key blocks per query block
//
// Only estimate_cuda.cu includes this (everything keeps internal linkage, as when it lived there) and the
// host emulation of tests/emulation, which compiles the same code with the host compiler (TESSERA_EMULATION
// defined), runs every CUDA lane as a fiber and supplies, under that macro, what is PTX or dynamic shared
// memory here.
#pragma once

#include "attention/cuda/bs_score_kernels.cuh"
#include "attention/cuda/bs_select_kernels.cuh"
#include "attention/cuda/vs_estimate_kernels.cuh"
#include "attention/cuda/vs_select_kernels.cuh"
