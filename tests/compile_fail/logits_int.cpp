// Must NOT compile: integer logits are not a CPU dtype.
#include "two_rows.hpp"

int main() { forward_into_float_outputs<int>(); }
