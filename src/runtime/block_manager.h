// BlockManager: the KV cache's block pool. A BlockAllocator-style free list with reference counts,
// plus a prefix cache: every full block is keyed by a hash chained along its prefix (parent block,
// then its 16 token ids), so a new sequence whose prompt starts the same reuses the blocks, shared.
// Freed blocks that carry a hash stay findable until they are reused (least recently freed first).
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "runtime/sequence.h"

namespace nb {

class BlockManager {
 public:
  BlockManager(int32_t n_blocks, bool enable_prefix_caching);

  int32_t n_blocks() const { return static_cast<int32_t>(blocks_.size()); }
  int32_t n_free() const { return n_free_; }               // reusable now: unreferenced, cached or not
  int32_t n_used() const { return n_blocks() - n_free_; }  // referenced by at least one sequence
  int32_t ref_count(int32_t block) const { return blocks_[block].ref; }
  bool is_cached(int32_t block) const { return blocks_[block].hash != 0; }

  // Leading full blocks of seq's tokens found in the prefix cache, at most up to tokens[size - 2]
  // (the last token is always recomputed, to produce logits). Takes no reference.
  std::vector<int32_t> match_prefix(const Sequence& seq) const;
  // First admission of a sequence with an empty block table: takes the matched blocks (shared), sets
  // n_computed past them, and allocates fresh blocks so it can hold n_computed + n_new tokens.
  // Returns false, changing nothing, when the pool is short.
  bool admit(Sequence& seq, const std::vector<int32_t>& matched, int32_t n_new);
  // Whether seq can grow to n_tokens, and growing it (false: nothing changed).
  bool can_grow(const Sequence& seq, int32_t n_tokens) const;
  bool grow(Sequence& seq, int32_t n_tokens);
  // After a forward pass: registers seq's newly full, computed blocks in the prefix cache.
  void commit(Sequence& seq);
  // Drops seq's references (blocks and table); n_computed and n_hashed go back to 0.
  void release(Sequence& seq);

  // Counters for the metrics: prefix-cache queries and hits, in tokens.
  int64_t prefix_queries() const { return prefix_queries_; }
  int64_t prefix_hits() const { return prefix_hits_; }

 private:
  struct Block {
    int32_t ref = 0;
    uint64_t hash = 0;  // 0: not in the prefix cache
    uint64_t parent_hash = 0;
    std::vector<int32_t> tokens;   // the kKvBlock ids it holds, when cached (verifies a hash hit)
    int32_t prev = -1, next = -1;  // free list links (only while ref == 0)
  };

  static uint64_t chain_hash(uint64_t parent_hash, const int32_t* tokens);
  void list_remove(int32_t b);
  void list_push_front(int32_t b);
  void list_push_back(int32_t b);
  int32_t take_free();  // pops the least recently freed block, evicting its cache entry
  void uncache(int32_t b);

  std::vector<Block> blocks_;
  int32_t head_ = -1, tail_ = -1, n_free_ = 0;
  bool prefix_caching_;
  std::unordered_map<uint64_t, int32_t> cache_;  // chain hash -> block
  int64_t prefix_queries_ = 0, prefix_hits_ = 0;
};

}  // namespace nb
