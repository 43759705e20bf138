// Must NOT compile: double logits accumulate in double, so their outputs are
// basic_forward_outputs<double>; float outputs would round what the call computed.
#include "two_rows.hpp"

int main() { forward_into_float_outputs<double>(); }
