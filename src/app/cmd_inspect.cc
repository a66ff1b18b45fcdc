// nibble inspect: what a checkpoint holds, as the model loader sees it (after full validation).
#include <cstdio>

#include "app/model_commands.h"
#include "model/model.h"

namespace nb {

int cmd_inspect(const InspectArgs& args) {
  ModelOptions options;
  options.n_threads = 1;
  auto model = Model::load(args.model, options);
  if (!model.ok()) {
    std::fprintf(stderr, "nibble: error: %s\n", model.status().message().c_str());
    return 1;
  }
  std::fputs(model.value()->describe().c_str(), stdout);
  return 0;
}

}  // namespace nb
