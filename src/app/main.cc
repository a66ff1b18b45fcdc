// nibble command line: run, eval, tokenize, inspect (serve, bench, quantize follow).
#include <cstdio>

int main(int argc, char** argv) {
  (void)argc;
  (void)argv;
  std::fprintf(stderr, "nibble: usage: nibble <run|eval|tokenize|inspect> ...\n");
  return 2;
}
