-- bench/growth's large-body workload: PUTs of one BYTES-byte body (default 1,000,000) to
-- /accounts/{n % 10000} with a strictly increasing Fencing-Token, so through fencegate every
-- one is an admitted raise on a fenced route, and the body is streamed to the upstream.
-- Arguments (after `--`): first token, BYTES.
local dir = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
dofile(dir .. "report.lua")

local base, n, body = 1, 0, nil

init = function(args)
  base = tonumber(args[1]) or base
  body = string.rep("x", tonumber(args[2]) or 1000000)
end

request = function()
  local token = base + n
  local id = n % 10000
  n = n + 1
  return wrk.format("PUT", "/accounts/" .. id, {
    ["Fencing-Token"] = string.format("%.0f", token),
    ["Content-Type"] = "application/octet-stream",
  }, body)
end
