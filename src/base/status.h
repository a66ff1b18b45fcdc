// Errors as values. Bad input (files, configs, requests, flags) returns a Status naming the culprit;
// a broken invariant inside nibble is a bug and aborts through NB_CHECK with file and line.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <variant>

namespace nb {

// A one-line error message, or nothing. Messages name the file, tensor, field or flag at fault.
class [[nodiscard]] Status {
 public:
  Status() = default;
  static Status ok_status() { return Status(); }
  static Status error(std::string message) {
    Status s;
    s.message_ = message.empty() ? "unknown error" : std::move(message);
    return s;
  }
  bool ok() const { return message_.empty(); }
  const std::string& message() const { return message_; }
  // Prefixes context: "model.safetensors: " + "tensor 'x': bad offsets".
  Status with_context(const std::string& context) const {
    return ok() ? *this : error(context + ": " + message_);
  }

 private:
  std::string message_;
};

inline Status error(std::string message) { return Status::error(std::move(message)); }

// A value or an error. Small on purpose: value(), status(), ok().
template <class T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {
    if (std::get<Status>(v_).ok()) v_ = Status::error("Result built from an ok Status");
  }
  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() { return value(); }

 private:
  std::variant<T, Status> v_;
};

[[noreturn]] inline void check_failed(const char* expr, const char* file, int line, const std::string& msg) {
  std::fprintf(stderr, "nibble: internal error: %s:%d: check failed: %s%s%s\n", file, line, expr,
               msg.empty() ? "" : ": ", msg.c_str());
  std::abort();
}

// A condition the user can cause and no caller can recover from mid-step (the GPU ran out of memory, the
// device failed): one line on stderr, exit status 1, no abort and no core dump. Other threads are not
// joined (std::_Exit), which is what an out-of-memory inside a forward pass needs.
[[noreturn]] inline void fatal_error(const std::string& msg) {
  std::fprintf(stderr, "nibble: error: %s\n", msg.c_str());
  std::fflush(stderr);
  std::_Exit(1);
}

}  // namespace nb

#define NB_CONCAT_INNER(a, b) a##b
#define NB_CONCAT(a, b) NB_CONCAT_INNER(a, b)

// Return the Status if it is an error.
#define NB_RETURN_IF_ERROR(expr)              \
  do {                                        \
    ::nb::Status nb_status_ = (expr);         \
    if (!nb_status_.ok()) return nb_status_;  \
  } while (0)

// auto x = NB_TRY(f());  is spelled  NB_ASSIGN_OR_RETURN(auto x, f());
#define NB_ASSIGN_OR_RETURN(lhs, expr)                                      \
  auto NB_CONCAT(nb_result_, __LINE__) = (expr);                            \
  if (!NB_CONCAT(nb_result_, __LINE__).ok())                                \
    return NB_CONCAT(nb_result_, __LINE__).status();                        \
  lhs = std::move(NB_CONCAT(nb_result_, __LINE__)).value()

// Always-on invariant check (bugs, not bad input).
#define NB_CHECK(cond, ...)                                                              \
  do {                                                                                   \
    if (!(cond)) ::nb::check_failed(#cond, __FILE__, __LINE__, ::std::string{__VA_ARGS__}); \
  } while (0)
