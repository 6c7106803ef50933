// tessera/server/stop_matcher.h — stop sequences over streamed text.
//
// Text arrives piece by piece (one token's worth of whole UTF-8 characters at a time). push() returns the part
// that can be sent to the client: it holds back a tail that could still grow into a stop sequence, and once a
// stop sequence appears it returns the text before it and reports stopped(); the sequence and anything after it
// are never sent (the OpenAI API's semantics). flush() returns what is held back when generation ends without
// a stop sequence.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace tessera::server {

class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops);
  std::string push(std::string_view text);
  std::string flush();
  bool stopped() const { return stopped_; }

 private:
  std::vector<std::string> stops_;
  std::string held_;
  bool stopped_ = false;
};

}  // namespace tessera::server
