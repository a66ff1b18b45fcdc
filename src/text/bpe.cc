// Heap-driven BPE: a doubly linked list of symbols over the piece's bytes and a min-heap of candidate
// merges keyed by (priority, position), with stale entries skipped when popped. O(n log n) per piece,
// so a pathological 100 kB piece without spaces costs milliseconds, not minutes.
#include "text/bpe.h"

#include <algorithm>
#include <queue>

namespace nb::text {

void BytesIndex::reset(const std::vector<std::string>* strings, size_t expected) {
  strings_ = strings;
  size_ = 0;
  size_t n = 16;
  while (n < expected * 2) n *= 2;  // load factor <= 1/2 keeps probe runs short
  slots_.assign(n, Slot{0, -1});
}

void BytesIndex::grow() {
  std::vector<Slot> old = std::move(slots_);
  slots_.assign(old.size() * 2, Slot{0, -1});
  size_t mask = slots_.size() - 1;
  for (const Slot& s : old) {
    if (s.tag == 0) continue;
    size_t i = hash((*strings_)[s.id]) & mask;
    while (slots_[i].tag != 0) i = (i + 1) & mask;
    slots_[i] = s;
  }
}

bool BytesIndex::insert(int32_t id) {
  if ((size_ + 1) * 2 > slots_.size()) grow();
  std::string_view bytes = (*strings_)[id];
  uint64_t h = hash(bytes);
  uint32_t tag = tag_of(h);
  size_t mask = slots_.size() - 1;
  size_t i = h & mask;
  for (; slots_[i].tag != 0; i = (i + 1) & mask) {
    if (slots_[i].tag == tag && (*strings_)[slots_[i].id] == bytes) return false;
  }
  slots_[i] = Slot{tag, id};
  ++size_;
  return true;
}

int32_t BytesIndex::find(std::string_view bytes) const {
  if (slots_.empty()) return -1;
  uint64_t h = hash(bytes);
  uint32_t tag = tag_of(h);
  size_t mask = slots_.size() - 1;
  for (size_t i = h & mask; slots_[i].tag != 0; i = (i + 1) & mask) {
    if (slots_[i].tag == tag && (*strings_)[slots_[i].id] == bytes) return slots_[i].id;
  }
  return -1;
}

void MergeRules::reset(size_t expected) {
  size_t n = 16;
  while (n < expected * 2) n *= 2;
  slots_.assign(n, Slot{kEmpty, {}});
  size_ = 0;
}

void MergeRules::insert_or_assign(uint64_t key, MergeRule rule) {
  if ((size_ + 1) * 2 > slots_.size()) {
    std::vector<Slot> old = std::move(slots_);
    reset(std::max<size_t>(old.size(), 16));
    for (const Slot& s : old) {
      if (s.key != kEmpty) insert_or_assign(s.key, s.rule);
    }
  }
  size_t mask = slots_.size() - 1;
  size_t i = hash(key) & mask;
  while (slots_[i].key != kEmpty && slots_[i].key != key) i = (i + 1) & mask;
  if (slots_[i].key == kEmpty) ++size_;
  slots_[i] = Slot{key, rule};
}

const MergeRule* MergeRules::find(uint64_t key) const {
  if (slots_.empty()) return nullptr;
  size_t mask = slots_.size() - 1;
  for (size_t i = hash(key) & mask; slots_[i].key != kEmpty; i = (i + 1) & mask) {
    if (slots_[i].key == key) return &slots_[i].rule;
  }
  return nullptr;
}

namespace {

struct Symbol {
  uint32_t begin, end;  // byte span within the piece
  int32_t prev, next;   // neighbouring live symbols, -1 at the ends
  int32_t id;           // token id (rank for tiktoken)
  bool alive;
};

struct Candidate {
  int32_t priority;
  int32_t left;                  // index of the left symbol (its begin never changes)
  uint32_t left_end, right_end;  // spans at push time; a changed span means the entry is stale
  int32_t result;
  bool operator>(const Candidate& o) const {
    return priority != o.priority ? priority > o.priority : left > o.left;
  }
};

// Runs the merge loop. `rule(left, right, &priority, &result)` says whether two adjacent symbols merge.
template <class Rule>
void merge_symbols(std::vector<Symbol>& syms, Rule&& rule, std::vector<int32_t>* out) {
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
  auto push = [&](int32_t left) {
    if (left < 0) return;
    int32_t right = syms[left].next;
    if (right < 0) return;
    int32_t priority = 0, result = 0;
    if (rule(syms[left], syms[right], &priority, &result)) {
      heap.push({priority, left, syms[left].end, syms[right].end, result});
    }
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(syms.size()); ++i) push(i);
  while (!heap.empty()) {
    Candidate c = heap.top();
    heap.pop();
    Symbol& left = syms[c.left];
    if (!left.alive || left.end != c.left_end || left.next < 0) continue;
    Symbol& right = syms[left.next];
    if (right.end != c.right_end) continue;
    left.end = right.end;
    left.id = c.result;
    left.next = right.next;
    right.alive = false;
    if (left.next >= 0) syms[left.next].prev = c.left;
    push(left.prev);
    push(c.left);
  }
  for (int32_t i = 0; i >= 0 && i < static_cast<int32_t>(syms.size()); i = syms[i].next) {
    if (syms[i].id >= 0) out->push_back(syms[i].id);
  }
}

std::vector<Symbol> byte_symbols(std::string_view piece) {
  std::vector<Symbol> syms(piece.size());
  for (size_t i = 0; i < piece.size(); ++i) {
    auto n = static_cast<int32_t>(i);
    syms[i] = {static_cast<uint32_t>(i),
               static_cast<uint32_t>(i + 1),
               n - 1,
               i + 1 < piece.size() ? n + 1 : -1,
               -1,
               true};
  }
  return syms;
}

}  // namespace

void bpe_by_rank(std::string_view piece, const BytesIndex& ranks, std::vector<int32_t>* out) {
  if (piece.empty()) return;
  std::vector<Symbol> syms = byte_symbols(piece);
  for (auto& s : syms) s.id = ranks.find(piece.substr(s.begin, 1));
  merge_symbols(
      syms,
      [&](const Symbol& l, const Symbol& r, int32_t* priority, int32_t* result) {
        int32_t rank = ranks.find(piece.substr(l.begin, r.end - l.begin));
        if (rank < 0) return false;
        *priority = *result = rank;
        return true;
      },
      out);
}

void bpe_by_merges(std::string_view piece, const int32_t* byte_ids, const MergeRules& merges,
                   std::vector<int32_t>* out) {
  if (piece.empty()) return;
  std::vector<Symbol> syms = byte_symbols(piece);
  for (auto& s : syms) s.id = byte_ids[static_cast<unsigned char>(piece[s.begin])];
  merge_symbols(
      syms,
      [&](const Symbol& l, const Symbol& r, int32_t* priority, int32_t* result) {
        if (l.id < 0 || r.id < 0) return false;
        const MergeRule* rule = merges.find(merge_key(l.id, r.id));
        if (rule == nullptr) return false;
        *priority = rule->rank;
        *result = rule->result;
        return true;
      },
      out);
}

}  // namespace nb::text
