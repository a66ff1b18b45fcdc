// SAX handler for tokenizer.json: a tiny DOM builder for the generic parts plus two fast paths.
#include "text/hf_json.h"

namespace nb::text {
namespace {

using json = nlohmann::json;

class Handler : public nlohmann::json_sax<json> {
 public:
  explicit Handler(HfTokenizerJson* out) : out_(out) {}
  std::string error;

  bool null() override { return scalar(json()); }
  bool boolean(bool v) override { return scalar(json(v)); }
  bool number_integer(number_integer_t v) override { return number(v, json(v)); }
  bool number_unsigned(number_unsigned_t v) override {
    return number(v > static_cast<number_unsigned_t>(INT64_MAX) ? -1 : static_cast<int64_t>(v), json(v));
  }
  bool number_float(number_float_t v, const string_t&) override {
    if (mode_ != kGeneric) return fail("model." + mode_name() + " holds a non-integer number");
    return scalar(json(v));
  }
  bool binary(binary_t&) override { return fail("unexpected binary value"); }
  bool string(string_t& v) override {
    if (mode_ == kMerges && depth_ == mode_depth_) {
      size_t space = v.find(' ');
      if (space == std::string::npos || v.find(' ', space + 1) != std::string::npos) {
        return fail("merges[" + std::to_string(out_->merges.size()) + "] '" + v + "' is not 'A B'");
      }
      out_->merges.emplace_back(v.substr(0, space), v.substr(space + 1));
      return true;
    }
    if (mode_ == kMerges && depth_ == mode_depth_ + 1) {
      if (pair_.size() >= 2) return fail(merge_shape_error());
      pair_.push_back(std::move(v));
      return true;
    }
    if (mode_ == kVocab) return fail("model.vocab['" + key_ + "'] is not an integer id");
    return scalar(json(std::move(v)));
  }
  bool key(string_t& k) override {
    key_ = std::move(k);
    return true;
  }
  bool start_object(std::size_t) override {
    if (mode_ == kGeneric && in_model() && key_ == "vocab") return enter(kVocab);
    if (mode_ != kGeneric) return fail("model." + mode_name() + " has an unexpected object");
    return open(json::object());
  }
  bool end_object() override { return close(); }
  bool start_array(std::size_t) override {
    if (mode_ == kGeneric && in_model() && key_ == "merges") return enter(kMerges);
    if (mode_ == kMerges && depth_ == mode_depth_) {
      ++depth_;
      pair_.clear();
      return true;
    }
    if (mode_ != kGeneric) return fail("model." + mode_name() + " has an unexpected array");
    return open(json::array());
  }
  bool end_array() override {
    if (mode_ == kMerges && depth_ == mode_depth_ + 1) {
      if (pair_.size() != 2) return fail(merge_shape_error());
      out_->merges.emplace_back(std::move(pair_[0]), std::move(pair_[1]));
      --depth_;
      return true;
    }
    return close();
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    if (error.empty()) error = std::string("invalid JSON: ") + e.what();
    return false;
  }

 private:
  enum Mode { kGeneric, kVocab, kMerges };

  std::string mode_name() const { return mode_ == kVocab ? "vocab" : "merges"; }
  std::string merge_shape_error() const {
    return "merges[" + std::to_string(out_->merges.size()) + "] is not a pair of strings";
  }
  bool fail(std::string message) {
    if (error.empty()) error = std::move(message);
    return false;
  }
  // True while the parser is directly inside the top-level "model" object.
  bool in_model() const { return stack_.size() == 2 && model_ != nullptr && stack_.back() == model_; }

  bool enter(Mode mode) {
    mode_ = mode;
    mode_depth_ = ++depth_;
    (mode == kVocab ? out_->has_vocab : out_->has_merges) = true;
    return true;
  }
  bool number(int64_t v, json value) {
    if (mode_ == kVocab) {
      out_->vocab.emplace_back(std::move(key_), v);
      return true;
    }
    if (mode_ != kGeneric) return fail("model.merges holds a number");
    return scalar(std::move(value));
  }
  json* put(json value) {
    if (stack_.empty()) {
      out_->rest = std::move(value);
      return &out_->rest;
    }
    json* top = stack_.back();
    if (top->is_object()) {
      json& slot = (*top)[key_];
      slot = std::move(value);
      return &slot;
    }
    top->push_back(std::move(value));
    return &top->back();
  }
  bool scalar(json value) {
    if (mode_ != kGeneric) return fail("model." + mode_name() + " has an unexpected value");
    put(std::move(value));
    return true;
  }
  bool open(json container) {
    bool is_model = stack_.size() == 1 && key_ == "model";
    json* p = put(std::move(container));
    if (is_model) model_ = p;
    stack_.push_back(p);
    ++depth_;
    return true;
  }
  bool close() {
    if (mode_ != kGeneric && depth_ == mode_depth_) {
      mode_ = kGeneric;
      --depth_;
      return true;
    }
    stack_.pop_back();
    --depth_;
    return true;
  }

  HfTokenizerJson* out_;
  std::vector<json*> stack_;
  json* model_ = nullptr;
  std::string key_;
  std::vector<std::string> pair_;
  Mode mode_ = kGeneric;
  int depth_ = 0, mode_depth_ = 0;
};

}  // namespace

Result<HfTokenizerJson> parse_hf_tokenizer_json(const std::string& path, const std::string& data) {
  HfTokenizerJson out;
  Handler handler(&out);
  bool ok = false;
  try {
    ok = json::sax_parse(data, &handler);
  } catch (const json::exception& e) {
    return error(path + ": invalid JSON: " + e.what());
  }
  if (!ok) return error(path + ": " + (handler.error.empty() ? "invalid JSON" : handler.error));
  return out;
}

}  // namespace nb::text
