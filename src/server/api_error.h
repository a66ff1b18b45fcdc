// ApiError: an OpenAI-shaped error, {"error": {"message", "type", "param", "code"}}, with the HTTP
// status as code. Types follow vLLM's names: BadRequestError (400), AuthenticationError (401),
// NotFoundError (404), RequestTooLargeError (413), RateLimitError (429), InternalServerError (500),
// ServiceUnavailableError (503).
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace nb {

struct ApiError {
  int status = 400;
  std::string message;
  std::string param;  // the request field at fault, or empty (null on the wire)

  std::string type() const {
    switch (status) {
      case 400:
        return "BadRequestError";
      case 401:
        return "AuthenticationError";
      case 404:
        return "NotFoundError";
      case 413:
        return "RequestTooLargeError";
      case 429:
        return "RateLimitError";
      case 503:
        return "ServiceUnavailableError";
      default:
        return "InternalServerError";
    }
  }
  nlohmann::json to_json() const {
    nlohmann::json e = {{"message", message}, {"type", type()}, {"code", status}};
    e["param"] = param.empty() ? nlohmann::json(nullptr) : nlohmann::json(param);
    return {{"error", e}};
  }
};

inline ApiError bad_request(std::string message, std::string param = "") {
  return ApiError{400, std::move(message), std::move(param)};
}

}  // namespace nb
