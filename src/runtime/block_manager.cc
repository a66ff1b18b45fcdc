#include "runtime/block_manager.h"

#include <algorithm>

#include "base/status.h"

namespace nb {

BlockManager::BlockManager(int32_t n_blocks, bool enable_prefix_caching)
    : blocks_(n_blocks), prefix_caching_(enable_prefix_caching) {
  NB_CHECK(n_blocks > 0);
  for (int32_t b = 0; b < n_blocks; ++b) list_push_back(b);
}

uint64_t BlockManager::chain_hash(uint64_t parent_hash, const int32_t* tokens) {
  // FNV-1a over the parent hash and the block's ids; 0 is reserved for "not cached".
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](uint64_t v) {
    for (int i = 0; i < 8; ++i, v >>= 8) h = (h ^ (v & 0xff)) * 1099511628211ull;
  };
  mix(parent_hash);
  for (int i = 0; i < kKvBlock; ++i) mix(static_cast<uint32_t>(tokens[i]));
  return h == 0 ? 1 : h;
}

void BlockManager::list_remove(int32_t b) {
  Block& k = blocks_[b];
  (k.prev >= 0 ? blocks_[k.prev].next : head_) = k.next;
  (k.next >= 0 ? blocks_[k.next].prev : tail_) = k.prev;
  k.prev = k.next = -1;
  --n_free_;
}

void BlockManager::list_push_front(int32_t b) {
  blocks_[b].prev = -1;
  blocks_[b].next = head_;
  (head_ >= 0 ? blocks_[head_].prev : tail_) = b;
  head_ = b;
  ++n_free_;
}

void BlockManager::list_push_back(int32_t b) {
  blocks_[b].next = -1;
  blocks_[b].prev = tail_;
  (tail_ >= 0 ? blocks_[tail_].next : head_) = b;
  tail_ = b;
  ++n_free_;
}

void BlockManager::uncache(int32_t b) {
  Block& k = blocks_[b];
  if (k.hash == 0) return;
  auto it = cache_.find(k.hash);
  if (it != cache_.end() && it->second == b) cache_.erase(it);
  k.hash = k.parent_hash = 0;
  k.tokens.clear();
}

int32_t BlockManager::take_free() {
  NB_CHECK(head_ >= 0, "no free block");
  const int32_t b = head_;
  list_remove(b);
  uncache(b);
  blocks_[b].ref = 1;
  return b;
}

std::vector<int32_t> BlockManager::match_prefix(const Sequence& seq) const {
  std::vector<int32_t> matched;
  if (!prefix_caching_) return matched;
  const int32_t n_full = std::max(seq.size() - 1, 0) / kKvBlock;
  uint64_t parent = 0;
  for (int32_t i = 0; i < n_full; ++i) {
    const int32_t* ids = seq.tokens.data() + i * kKvBlock;
    const uint64_t h = chain_hash(parent, ids);
    auto it = cache_.find(h);
    if (it == cache_.end()) break;
    const Block& k = blocks_[it->second];
    if (k.parent_hash != parent || !std::equal(k.tokens.begin(), k.tokens.end(), ids)) break;
    matched.push_back(it->second);
    parent = h;
  }
  return matched;
}

bool BlockManager::admit(Sequence& seq, const std::vector<int32_t>& matched, int32_t n_new) {
  NB_CHECK(seq.block_table.empty() && seq.n_computed == 0);
  const int32_t n_matched = static_cast<int32_t>(matched.size());
  int32_t matched_free = 0;
  for (int32_t b : matched) matched_free += blocks_[b].ref == 0;
  const int32_t n_fresh = blocks_for(n_matched * kKvBlock + n_new) - n_matched;
  if (n_fresh > n_free_ - matched_free) return false;
  for (int32_t b : matched) {
    if (blocks_[b].ref++ == 0) list_remove(b);
    seq.block_table.push_back(b);
  }
  for (int32_t i = 0; i < n_fresh; ++i) seq.block_table.push_back(take_free());
  seq.n_computed = seq.n_hashed = n_matched;
  seq.n_computed *= kKvBlock;
  seq.chain_hash = n_matched > 0 ? blocks_[matched.back()].hash : 0;
  if (prefix_caching_) {
    prefix_queries_ += seq.size();
    prefix_hits_ += seq.n_computed;
  }
  return true;
}

bool BlockManager::can_grow(const Sequence& seq, int32_t n_tokens) const {
  return blocks_for(n_tokens) - static_cast<int32_t>(seq.block_table.size()) <= n_free_;
}

bool BlockManager::grow(Sequence& seq, int32_t n_tokens) {
  if (!can_grow(seq, n_tokens)) return false;
  while (static_cast<int32_t>(seq.block_table.size()) < blocks_for(n_tokens))
    seq.block_table.push_back(take_free());
  return true;
}

void BlockManager::commit(Sequence& seq) {
  if (!prefix_caching_) return;
  const int32_t n_full = std::min(seq.n_computed / kKvBlock, static_cast<int32_t>(seq.block_table.size()));
  for (int32_t i = seq.n_hashed; i < n_full; ++i) {
    const int32_t* ids = seq.tokens.data() + i * kKvBlock;
    const uint64_t h = chain_hash(seq.chain_hash, ids);
    Block& k = blocks_[seq.block_table[i]];
    if (k.hash == 0 && !cache_.count(h)) {  // a block with the same content may already be cached
      k.hash = h;
      k.parent_hash = seq.chain_hash;
      k.tokens.assign(ids, ids + kKvBlock);
      cache_[h] = seq.block_table[i];
    }
    seq.chain_hash = h;
    seq.n_hashed = i + 1;
  }
}

void BlockManager::release(Sequence& seq) {
  // Last blocks first to the front of the free list so the tail of a prefix is reused before its
  // head; uncached blocks go to the front (nothing to keep), cached ones to the back (kept longest).
  for (auto it = seq.block_table.rbegin(); it != seq.block_table.rend(); ++it) {
    Block& k = blocks_[*it];
    NB_CHECK(k.ref > 0, "double free of block " + std::to_string(*it));
    if (--k.ref > 0) continue;
    if (k.hash != 0)
      list_push_back(*it);
    else
      list_push_front(*it);
  }
  seq.block_table.clear();
  seq.n_computed = seq.n_hashed = 0;
  seq.chain_hash = 0;
}

}  // namespace nb
