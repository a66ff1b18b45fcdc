// Byte-pair merging of one pre-tokenized piece, in the two flavours nibble loads: tiktoken (merge the
// adjacent pair whose concatenation has the lowest rank) and HF tokenizer.json (merge the adjacent
// pair of ids with the lowest merge-list index). Both pick the leftmost pair on ties.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace nb::text {

// Token bytes -> id, as an open-addressing table of (hash tag, id) slots whose keys live in the
// tokenizer's id -> bytes vector. Loading o200k spends most of its time in these lookups, and a
// node-based std::unordered_map costs a cache miss per hop plus a malloc per entry.
class BytesIndex {
 public:
  // `strings` is the id -> bytes table; it must outlive the index (it may grow, not change entries).
  void reset(const std::vector<std::string>* strings, size_t expected);
  // False (and no change) when another id already has the same bytes.
  bool insert(int32_t id);
  // -1 when absent.
  int32_t find(std::string_view bytes) const;
  size_t size() const { return size_; }

 private:
  struct Slot {
    uint32_t tag;  // high hash bits; 0 marks an empty slot
    int32_t id;
  };
  static uint64_t hash(std::string_view s) { return std::hash<std::string_view>{}(s); }
  static uint32_t tag_of(uint64_t h) { return static_cast<uint32_t>(h >> 32) | 1u; }
  void grow();

  const std::vector<std::string>* strings_ = nullptr;
  std::vector<Slot> slots_;
  size_t size_ = 0;
};

struct MergeRule {
  int32_t rank;    // index in the merge list: lower merges first
  int32_t result;  // id of the merged token
};
inline uint64_t merge_key(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

// (left id, right id) -> MergeRule, open addressing like BytesIndex: it is probed for every adjacent
// pair during merge-list BPE and filled with ~200k rules at load.
class MergeRules {
 public:
  void reset(size_t expected);
  // A repeated pair takes the later rule, as HF's map construction does.
  void insert_or_assign(uint64_t key, MergeRule rule);
  const MergeRule* find(uint64_t key) const;

 private:
  struct Slot {
    uint64_t key;  // kEmpty when unused; real keys hold two ids below 2^31
    MergeRule rule;
  };
  static constexpr uint64_t kEmpty = ~uint64_t{0};
  static size_t hash(uint64_t key) { return static_cast<size_t>((key * 0x9E3779B97F4A7C15ull) >> 20); }

  std::vector<Slot> slots_;
  size_t size_ = 0;
};

// tiktoken: every single byte must have a rank. Appends the ids of `piece` to `out`.
void bpe_by_rank(std::string_view piece, const BytesIndex& ranks, std::vector<int32_t>* out);

// HF: `byte_ids[b]` is the id of the one-byte token b (-1 when absent; such bytes are skipped as HF
// skips symbols it cannot map). Appends the ids of `piece` to `out`.
void bpe_by_merges(std::string_view piece, const int32_t* byte_ids, const MergeRules& merges,
                   std::vector<int32_t>* out);

}  // namespace nb::text
