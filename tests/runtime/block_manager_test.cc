// BlockManager: allocation and release with reference counts, prefix sharing along the hash chain
// (a hit needs the same tokens and the same parent), eviction order of cached free blocks, and that
// the pool never leaks: n_used returns to 0 after every sequence is released.
#include "runtime/block_manager.h"

#include <gtest/gtest.h>

#include <numeric>

namespace nb {
namespace {

Sequence make_seq(uint64_t id, int n_tokens, int first = 0) {
  Sequence s;
  s.id = id;
  s.tokens.resize(n_tokens);
  std::iota(s.tokens.begin(), s.tokens.end(), first);
  s.n_prompt = n_tokens;
  return s;
}

// Admits seq with all its tokens, "computes" them, and registers its full blocks.
void admit_all(BlockManager& bm, Sequence& s) {
  const auto matched = bm.match_prefix(s);
  ASSERT_TRUE(bm.admit(s, matched, s.size() - static_cast<int32_t>(matched.size()) * kKvBlock));
  s.n_computed = s.size();
  bm.commit(s);
}

TEST(BlockManager, AllocatesAndReleases) {
  BlockManager bm(8, /*enable_prefix_caching=*/false);
  Sequence a = make_seq(1, 40);  // 3 blocks
  EXPECT_TRUE(bm.admit(a, {}, 40));
  EXPECT_EQ(a.block_table.size(), 3u);
  EXPECT_EQ(bm.n_used(), 3);
  EXPECT_TRUE(bm.grow(a, 49));  // a 4th block
  EXPECT_EQ(bm.n_used(), 4);
  Sequence b = make_seq(2, 80);  // 5 blocks: only 4 left
  EXPECT_FALSE(bm.admit(b, {}, 80));
  EXPECT_TRUE(b.block_table.empty());
  EXPECT_EQ(bm.n_used(), 4);
  bm.release(a);
  EXPECT_EQ(bm.n_used(), 0);
  EXPECT_TRUE(bm.admit(b, {}, 80));
  bm.release(b);
  EXPECT_EQ(bm.n_free(), 8);
}

TEST(BlockManager, SharesFullPrefixBlocks) {
  BlockManager bm(16, true);
  Sequence a = make_seq(1, 40);
  admit_all(bm, a);
  EXPECT_EQ(a.n_hashed, 2);      // two full blocks registered
  Sequence b = make_seq(2, 45);  // same first 40 tokens, then more
  const auto matched = bm.match_prefix(b);
  ASSERT_EQ(matched.size(), 2u);
  EXPECT_EQ(matched[0], a.block_table[0]);
  EXPECT_EQ(matched[1], a.block_table[1]);
  ASSERT_TRUE(bm.admit(b, matched, b.size() - 32));
  EXPECT_EQ(b.n_computed, 32);
  EXPECT_EQ(bm.ref_count(a.block_table[0]), 2);
  EXPECT_EQ(bm.prefix_hits(), 32);
  bm.release(a);
  EXPECT_EQ(bm.ref_count(b.block_table[0]), 1);
  bm.release(b);
  EXPECT_EQ(bm.n_used(), 0);
}

TEST(BlockManager, NeverMatchesTheLastToken) {
  BlockManager bm(16, true);
  Sequence a = make_seq(1, 32);
  admit_all(bm, a);
  Sequence b = make_seq(2, 32);  // identical prompt: the last block is recomputed for its logits
  EXPECT_EQ(bm.match_prefix(b).size(), 1u);
}

TEST(BlockManager, ADifferentParentIsAMiss) {
  BlockManager bm(16, true);
  Sequence a = make_seq(1, 33);
  admit_all(bm, a);
  Sequence b = make_seq(2, 33);
  b.tokens[0] = 999;  // block 1 holds the same ids as a's, but after another prefix
  EXPECT_TRUE(bm.match_prefix(b).empty());
}

TEST(BlockManager, CachedFreeBlocksSurviveUntilReused) {
  BlockManager bm(4, true);
  Sequence a = make_seq(1, 33);  // 3 blocks, 2 full ones cached
  admit_all(bm, a);
  bm.release(a);
  EXPECT_EQ(bm.n_free(), 4);
  Sequence b = make_seq(2, 33);
  EXPECT_EQ(bm.match_prefix(b).size(), 2u);  // still findable after release
  // Fill the pool with other content: the cached blocks are evicted last, but they are evicted.
  Sequence c = make_seq(3, 64, 500);
  ASSERT_TRUE(bm.admit(c, {}, 64));
  EXPECT_TRUE(bm.match_prefix(b).empty());
  bm.release(c);
  EXPECT_EQ(bm.n_used(), 0);
}

TEST(BlockManager, EvictsUncachedBlocksFirst) {
  BlockManager bm(4, true);
  Sequence a = make_seq(1, 17);  // block 0 cached, block 1 not (partial)
  admit_all(bm, a);
  bm.release(a);
  Sequence c = make_seq(3, 48, 500);  // needs 3 of the 4 blocks: the cached one must survive
  ASSERT_TRUE(bm.admit(c, {}, 48));
  Sequence b = make_seq(2, 20);
  EXPECT_EQ(bm.match_prefix(b).size(), 1u);
  bm.release(c);
}

TEST(BlockManager, AdmitCountsMatchedFreeBlocks) {
  BlockManager bm(3, true);
  Sequence a = make_seq(1, 33);
  admit_all(bm, a);  // 3 blocks in use, 2 cached
  bm.release(a);
  Sequence b = make_seq(2, 48);  // matches 2 free cached blocks, needs 1 more: exactly the pool
  const auto matched = bm.match_prefix(b);
  ASSERT_EQ(matched.size(), 2u);
  ASSERT_TRUE(bm.admit(b, matched, 16));
  EXPECT_EQ(bm.n_free(), 0);
  bm.release(b);
  EXPECT_EQ(bm.n_free(), 3);
}

}  // namespace
}  // namespace nb
