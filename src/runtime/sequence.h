// Sequence: what the scheduler and the block manager know about one generation: its tokens (prompt,
// then output), how many of them have K/V in the cache, and the cache blocks that hold them.
// Sampling, stops and streaming belong to the engine's request record, not here.
#pragma once

#include <cstdint>
#include <vector>

#include "backend/backend.h"

namespace nb {

enum class SeqStatus : uint8_t { kWaiting, kRunning, kFinished };

struct Sequence {
  uint64_t id = 0;
  std::vector<int32_t> tokens;  // [n_prompt + n_output]
  int32_t n_prompt = 0;
  int32_t n_computed = 0;            // leading tokens whose K/V is in the cache
  std::vector<int32_t> block_table;  // block i holds positions kKvBlock*i .. kKvBlock*i + kKvBlock-1
  int32_t n_hashed = 0;              // leading blocks whose prefix-chain hash is known (cached or found)
  uint64_t chain_hash = 0;           // hash of block n_hashed - 1 along the chain (0: none yet)
  int32_t n_cached_prompt = 0;       // prompt tokens found in the prefix cache at first admission
  bool admitted_once = false;
  SeqStatus status = SeqStatus::kWaiting;

  int32_t size() const { return static_cast<int32_t>(tokens.size()); }
  int32_t n_output() const { return size() - n_prompt; }
  int32_t n_pending() const { return size() - n_computed; }  // tokens still to run through the model
};

inline int32_t blocks_for(int64_t n_tokens) {
  return static_cast<int32_t>((n_tokens + kKvBlock - 1) / kKvBlock);
}

}  // namespace nb
