// Logging to stderr: one line per event, with a level prefix. Verbosity is passed, not global state
// that changes under you: it is set once by main() before any thread starts.
#pragma once

#include <cstdarg>
#include <cstdio>

namespace nb {

enum class LogLevel { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };

inline LogLevel& log_level_storage() {
  static LogLevel level = LogLevel::kWarn;
  return level;
}
inline void set_log_level(LogLevel level) { log_level_storage() = level; }

#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
inline void log(LogLevel level, const char* fmt, ...) {
  if (level > log_level_storage()) return;
  static const char* kNames[] = {"error", "warn", "info", "debug"};
  char buf[2048];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, args);
  va_end(args);
  std::fprintf(stderr, "nibble %s: %s\n", kNames[static_cast<int>(level)], buf);
}

}  // namespace nb

#define NB_LOG_INFO(...) ::nb::log(::nb::LogLevel::kInfo, __VA_ARGS__)
#define NB_LOG_WARN(...) ::nb::log(::nb::LogLevel::kWarn, __VA_ARGS__)
#define NB_LOG_DEBUG(...) ::nb::log(::nb::LogLevel::kDebug, __VA_ARGS__)
