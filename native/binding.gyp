{
  "targets": [
    {
      "target_name": "forkling",
      "sources": ["<!@(find src -name '*.cc' | sort)"],
      "include_dirs": ["<!(node -p \"require('node-addon-api').include_dir\")", "src"],
      "dependencies": ["<!(node -p \"require('node-addon-api').targets\"):node_addon_api_except"],
      "cflags_cc!": ["-fno-exceptions", "-fno-rtti"],
      "cflags_cc": ["-std=c++20", "-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers"],
      "defines": ["NAPI_VERSION=8"]
    }
  ]
}
